"""The CogVideoX transformer's analytic FLOPs equal an independent count: torch's FlopCounterMode
over diffusers' CogVideoXTransformer3DModel (attention through the math backend), forward only."""

import pytest


@pytest.mark.parametrize("kind", ["1.0-t2v", "1.5-i2v", "1.0-2b"])
def test_cogvideox_flops_equal_torch_flop_counter(kind):
    import numpy as np
    import torch
    from diffusers import CogVideoXTransformer3DModel
    from helpers.cogvideox_reference import CONFIGS, TEXT, inputs, pipeline_rotary
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from mm_models_video import CogVideoXTransformer3DModel as Ours
    from mm_models_video import CogVideoXTransformerConfig

    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(**CONFIGS[kind]).eval()
    frames = 4 if kind.startswith("1.5") else 3
    batch = inputs(np.random.default_rng(0), kind, batch=1, frames=frames, text_len=TEXT)
    kwargs = {k: torch.from_numpy(np.asarray(v)) for k, v in batch.items() if k != "target"}
    if model.config.use_rotary_positional_embeddings:
        kwargs["image_rotary_emb"] = tuple(torch.from_numpy(t) for t in pipeline_rotary(model, frames, 6, 8))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(**kwargs)
    expected = counter.get_total_flops()
    config = CogVideoXTransformerConfig(**CONFIGS[kind])
    assert Ours.from_config(config).flops(batch) == expected


@pytest.mark.parametrize("frames, size", [(1, (16, 24)), (9, (16, 24)), (17, (24, 16)), (21, (16, 16))])
def test_vae_encode_flops_equal_torch_flop_counter(frames, size):
    """vae_encode_flops (what the planner charges online encoding) against FlopCounterMode over
    diffusers' AutoencoderKLCogVideoX.encode: one chunk, two chunks (17: 9 + 8; 21: 13 + 8)."""
    import torch
    from diffusers import AutoencoderKLCogVideoX
    from torch.utils.flop_counter import FlopCounterMode

    from mm_models_video.cogvideox.flops import vae_encode_flops

    config = dict(block_out_channels=[8, 16, 16, 24], latent_channels=4, layers_per_block=2, norm_num_groups=4)
    vae = AutoencoderKLCogVideoX(**config).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        vae.encode(torch.randn(1, 3, frames, *size))
    assert vae_encode_flops(config, frames, *size) == counter.get_total_flops()
