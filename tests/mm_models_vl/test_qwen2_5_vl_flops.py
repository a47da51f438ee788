"""Qwen2.5-VL's analytic FLOPs equal an independent count: torch's FlopCounterMode run over the
transformers model (every matmul, bmm and convolution it executes), forward only."""

import numpy as np
import pytest


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
                              image_token_id=290, video_token_id=291, vision_start_token_id=292,
                              vision_end_token_id=293)
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
    from mm_models_vl.qwen2_5_vl.flops import batch_flops, qwen2_5_vl_flops

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
    assert batch_flops(config, inputs) == expected  # what model.flops(batch) gives the trainer
