"""The analytic FLOPs equal an independent count: torch's FlopCounterMode run over the
transformers / diffusers reference models (every matmul, bmm and convolution they execute),
forward only."""

import numpy as np
import pytest

pytest.importorskip("torch")


def _reference(**text):
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text_config = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=96, vocab_size=300, bos_token_id=1, eos_token_id=2,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]})
    text_config.update(text)
    config = Qwen2_5_VLConfig(text_config=text_config,
                              vision_config=dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=48,
                                                 out_hidden_size=64, window_size=56, fullatt_block_indexes=[1]),
                              image_token_id=290, video_token_id=291, vision_start_token_id=292, vision_end_token_id=293)
    for c in (config, config.text_config, config.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(0)
    return config, Qwen2_5_VLForConditionalGeneration(config).eval()


def _count(model, **inputs):
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**{k: torch.from_numpy(v) for k, v in inputs.items()})
    return counter.get_total_flops()


@pytest.mark.parametrize("grids", [[], [(1, 8, 12)], [(1, 6, 10), (1, 4, 4)], [(3, 4, 6)]])
def test_qwen2_5_vl_flops_equal_torch_flop_counter(grids):
    from mm_profiling.flops import qwen2_5_vl_flops

    config, model = _reference()
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 280, 7).tolist()
    for t, h, w in grids:
        ids += [292] + [290 if t == 1 else 291] * (t * h * w // 4) + [293] + rng.integers(3, 280, 3).tolist()
    inputs = {"input_ids": np.array([ids], np.int64)}
    images = [g for g in grids if g[0] == 1]
    videos = [g for g in grids if g[0] > 1]
    if images:
        inputs["pixel_values"] = rng.standard_normal((sum(np.prod(g) for g in images), 1176)).astype(np.float32)
        inputs["image_grid_thw"] = np.array(images, np.int64)
    if videos:
        inputs["pixel_values_videos"] = rng.standard_normal((sum(np.prod(g) for g in videos), 1176)).astype(np.float32)
        inputs["video_grid_thw"] = np.array(videos, np.int64)
    types = np.zeros_like(inputs["input_ids"])
    types[inputs["input_ids"] == 290], types[inputs["input_ids"] == 291] = 1, 2
    inputs["mm_token_type_ids"] = types
    expected = _count(model, **inputs)
    got = qwen2_5_vl_flops(config, len(ids), image_grid_thw=images or None, video_grid_thw=videos or None)
    assert got == expected


def test_decoder_flops_follow_the_shapes():
    from mm_profiling.flops import decoder_lm_flops

    # one layer, no head: q, k, v, o, QK^T, PV, gate, up, down written out by hand
    s, h, nh, nkv, i = 10, 8, 2, 1, 12
    d = h // nh
    by_hand = 2 * s * h * (nh * d) + 2 * 2 * s * h * (nkv * d) + 2 * s * (nh * d) * h + 2 * nh * 2 * s * s * d \
        + 3 * 2 * s * h * i
    assert decoder_lm_flops(s, h, 1, nh, nkv, i, vocab=50, lm_head=False) == by_hand
    assert decoder_lm_flops(s, h, 1, nh, nkv, i, vocab=50) == by_hand + 2 * s * h * 50


@pytest.mark.parametrize("i2v", [False, True])
def test_wan_dit_flops_equal_torch_flop_counter(i2v):
    import torch
    from diffusers import WanTransformer3DModel
    from torch.utils.flop_counter import FlopCounterMode

    from mm_profiling.flops import wan_dit_flops

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
    assert wan_dit_flops(config, frames, height, width, text_len, image_len) == counter.get_total_flops()
