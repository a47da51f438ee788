"""LoRA in PEFT's format: adapters read from a PEFT folder, only adapters trainable, gathered
gradients under tp2 and tp2+SP equal one process, merge / unmerge, save round trip. (Training
steps with LoRA under tp: test_training.py.)"""

import json

import pytest
from helpers.lora_cases import run_lora_cases, write_adapters

LAYOUTS = {"tp2": {"tp": 2}, "tp2_sp": {"tp": 2, "sequence_parallel": True}}


def test_lora_single_process(tmp_path):
    write_adapters(tmp_path / "in")
    results = run_lora_cases(str(tmp_path / "in"), str(tmp_path / "out"), {"solo": {}})
    assert not {k: v for k, v in results.items() if v}, results
    config = json.loads((tmp_path / "out" / "solo" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0


@pytest.mark.distributed
def test_lora_tp2_equals_single_process(run_distributed, tmp_path):
    write_adapters(tmp_path / "in")
    results = run_distributed(run_lora_cases, nproc=2, timeout=300, adapter_dir=str(tmp_path / "in"),
                              out_dir=str(tmp_path / "out"), layouts=LAYOUTS)
    for rank, result in enumerate(results):
        assert set(result) == {"solo/trainable", *LAYOUTS}
        assert not {k: v for k, v in result.items() if v}, (rank, result)


def test_lora_errors(tmp_path):
    from helpers.reference_model import build_stack

    from mm_parallel import ParallelConfig
    from mm_parallel.lora import apply_lora
    from mm_parallel.topology import Topology

    stack = build_stack(Topology.build(ParallelConfig(), 1, 0))
    with pytest.raises(ValueError, match="no module matches"):
        apply_lora(stack, ["q_proj"])
