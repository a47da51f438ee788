"""The Wan2.1 DiT's analytic FLOPs equal an independent count: torch's FlopCounterMode run over
diffusers' WanTransformer3DModel, forward only."""

import pytest


@pytest.mark.parametrize("i2v", [False, True])
def test_wan_dit_flops_equal_torch_flop_counter(i2v):
    import torch
    from diffusers import WanTransformer3DModel
    from torch.utils.flop_counter import FlopCounterMode

    from mm_models_video.wan.flops import batch_flops, wan_dit_flops

    channels = 4
    config = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=channels,
                  out_channels=channels, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
                  qk_norm="rms_norm_across_heads", cross_attn_norm=True)
    if i2v:
        config.update(image_dim=24, added_kv_proj_dim=32, in_channels=2 * channels + 4)
    torch.manual_seed(0)
    model = WanTransformer3DModel(**config).eval()
    # the math backend decomposes attention into bmm, which FlopCounterMode counts (the fused CPU
    # kernel of the default backend is invisible to it)
    model.set_attention_backend("_native_math")
    frames, height, width = 3, 8, 12
    text_len = 512 if i2v else 16  # diffusers' I2V takes the last 512 context tokens as text
    image_len = 10 if i2v else 0
    inputs = {"hidden_states": torch.randn(1, config["in_channels"], frames, height, width),
              "timestep": torch.tensor([500]), "encoder_hidden_states": torch.randn(1, text_len, 32)}
    if i2v:
        inputs["encoder_hidden_states_image"] = torch.randn(1, image_len, 24)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**inputs)
    expected = counter.get_total_flops()
    assert wan_dit_flops(config, frames, height, width, text_len, image_len) == expected
    assert batch_flops(config, {k: v.numpy() for k, v in inputs.items()}) == expected  # model.flops(batch)


def test_per_token_timesteps_count_each_distinct_timestep_once():
    """Wan2.2 TI2V's per-token timesteps: diffusers embeds every token's timestep, ours each
    distinct value once; the count is FlopCounterMode's over diffusers less the time embedding of
    the tokens beyond the distinct values (one row's cost measured by FlopCounterMode too)."""
    import numpy as np
    import torch
    from diffusers import WanTransformer3DModel
    from helpers.wan_reference import first_frame_timesteps, tiny_config
    from torch.utils.flop_counter import FlopCounterMode

    from mm_models_video.wan.flops import batch_flops

    config = tiny_config()
    torch.manual_seed(0)
    model = WanTransformer3DModel(**config).eval()
    model.set_attention_backend("_native_math")
    frames, size, samples = 3, (8, 12), 2
    batch = {"hidden_states": np.random.default_rng(0).standard_normal((samples, 4, frames) + size).astype(np.float32),
             "timestep": first_frame_timesteps(np.array([500.0, 250.0]), frames, size),
             "encoder_hidden_states": np.zeros((samples, 16, 32), np.float32)}
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**{k: torch.from_numpy(v) for k, v in batch.items()})
    with torch.no_grad(), FlopCounterMode(display=False) as one_row:
        embedder = model.condition_embedder
        embedder.time_proj(embedder.act_fn(embedder.time_embedder(torch.zeros(1, config["freq_dim"]))))
    rows, distinct = batch["timestep"].size, 3  # 0, 500, 250
    expected = (counter.get_total_flops() - (rows - distinct) * one_row.get_total_flops()) / samples
    assert batch_flops(config, batch) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("version", ["2.1", "2.2"])
@pytest.mark.parametrize("frames, size", [(1, (32, 48)), (9, (48, 32)), (13, (32, 32))])
def test_vae_encode_flops_equal_torch_flop_counter(version, frames, size):
    """vae_encode_flops (what the planner charges online encoding) against FlopCounterMode over
    diffusers' AutoencoderKLWan.encode: Wan2.1's layout and Wan2.2's (diffusers' encoder fails with
    attn_scales set: its attention blocks take no feature cache)."""
    import torch
    from diffusers import AutoencoderKLWan
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from mm_models_video.wan.flops import vae_encode_flops

    config = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 3], num_res_blocks=2, temperal_downsample=[False, True, True])
    if version == "2.2":
        config.update(decoder_base_dim=12, is_residual=True, patch_size=2, in_channels=12, out_channels=12,
                      scale_factor_spatial=16, dim_mult=[1, 2, 2, 2])
    vae = AutoencoderKLWan(**config).eval()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        vae.encode(torch.randn(1, 3, frames, *size))
    assert vae_encode_flops(config, frames, *size) == counter.get_total_flops()
