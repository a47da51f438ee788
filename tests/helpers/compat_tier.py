"""The compat tier: what the `compat` test environment (the newest tested MindSpore and transformers,
hatch.toml) runs, chosen to catch what a new version breaks in one pass of about ten minutes:

- every family's parity against transformers / diffusers (the twins, the image and video
  processors, the text encoders): a changed reference or a changed MindSpore kernel shows as a
  parity failure. The DPO / GRPO objectives' parity against trl stays in the primary environment:
  trl needs datasets, whose releases for huggingface-hub 2 (transformers 5.25's) need pyarrow 24
  and so numpy 2, which MindSpore's wheels cannot take (docs/versions.md);
- one multi-process launch per family (its two-process layouts against one process): msrun, the
  collectives and the parallel regions on the new MindSpore;
- the built-in default run under every layout (the CLI, the launcher, the trainer);
- the contracts: the repository's (imports, packages, references, style) and the Ascend calls'
  (mm_parallel's stand-ins held to MindSpore's documented signatures);
- ms.jit's shared-bprop check (benchmarks/graph_mode.py), which decides our eager default.

Each entry is a pytest node id or its prefix (a folder, a file, a test); conftest.py keeps the items
it names and fails the session on an entry that names nothing.
"""

TIER = (
    "tests/contracts/",
    "tests/mm_parallel/test_ascend_contract.py",
    "tests/mm_data/test_qwen_image_processor.py",
    "tests/mm_data/test_qwen3_vl_processing.py",
    "tests/mm_models_vl/test_qwen2_5_vl_parity.py",
    "tests/mm_models_vl/test_qwen3_vl_parity.py",
    "tests/mm_models_vl/test_qwen2_5_omni_parity.py",
    "tests/mm_models_video/test_wan_parity.py",
    "tests/mm_models_video/test_cogvideox_parity.py",
    "tests/mm_models_video/test_encoders.py",
    "tests/mm_models_vl/test_qwen2_5_vl_parallel.py::test_two_process_layouts_equal_single_process",
    "tests/mm_models_vl/test_qwen3_vl_parallel.py::test_two_process_layouts_equal_single_process",
    "tests/mm_models_vl/test_qwen2_5_omni_parallel.py::test_two_process_layouts_equal_single_process",
    "tests/mm_models_video/test_wan_parallel.py::test_two_process_layouts_equal_single_process",
    "tests/mm_models_video/test_cogvideox_parallel.py::test_two_process_layouts_equal_single_process",
    "tests/mm_train/test_run.py::test_the_default_trains_the_same_under_dp2_tp2_pp2_and_cp2",
    "tests/benchmarks/test_graph_mode.py",
)


def in_tier(nodeid: str) -> bool:
    return any(nodeid.startswith(entry) for entry in TIER)


def unmatched(nodeids) -> list:
    """Entries of TIER that name no collected test (a renamed test must not leave the tier silently)."""
    return [entry for entry in TIER if not any(nodeid.startswith(entry) for nodeid in nodeids)]
