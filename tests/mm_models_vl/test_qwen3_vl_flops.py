"""Qwen3-VL's and Qwen3-VL-MoE's analytic FLOPs equal an independent count: torch's
FlopCounterMode over the transformers model (every matmul and convolution it runs; the MoE
experts as transformers runs them, each token through its top-k), forward only."""

import numpy as np
import pytest
from helpers.qwen3_vl_reference import sample, tiny_config


@pytest.mark.parametrize("moe,case", [(False, "text"), (False, "image_video"), (True, "image_video")])
def test_qwen3_vl_flops_equal_torch_flop_counter(moe, case):
    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    from mm_models_vl.qwen3_vl.flops import batch_flops

    torch.manual_seed(0)
    cls = transformers.Qwen3VLMoeForConditionalGeneration if moe else transformers.Qwen3VLForConditionalGeneration
    config = tiny_config(moe)
    if moe:  # the per-expert loop: FlopCounterMode counts half the FLOPs of the default grouped_mm (measured)
        config._experts_implementation = config.text_config._experts_implementation = "eager"
    model = cls(config).eval()
    inputs = sample(case, np.random.default_rng(0))
    inputs.pop("labels")
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**{k: torch.from_numpy(v) for k, v in inputs.items()})
    assert batch_flops(config, inputs) == counter.get_total_flops()
