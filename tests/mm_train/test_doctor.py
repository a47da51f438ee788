"""`mm-train doctor` on this CPU with 2 processes: every check runs and passes or says why it is
skipped (CANN, driver and bf16 kernels are Ascend's), JSON and table carry the same rows, and a
failure exits non-zero with what to do. With --recipe: the recipe's attention at its per-rank
shapes, and the probes of the forms MindSpore's page forbids (refused by the stand-ins here)."""

import json
import subprocess

import pytest
from helpers.hub_folders import write_hub_folder
from helpers.mm_train_cli import mm_train_command

pytestmark = pytest.mark.distributed


def _hub_folder(tmp_path, key):
    return write_hub_folder(tmp_path / key, key)


def test_the_doctor_passes_on_two_cpu_processes(tmp_path):
    model = _hub_folder(tmp_path, "Qwen3-VL-8B-Instruct")
    result = subprocess.run([mm_train_command(), "doctor", "--nproc", "2", "--json", "--recipe", "qwen3_vl_8b_sft",
                             "--set", f"model.path={model}"], capture_output=True, text=True, timeout=900,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(result.stdout)["rows"]
    status = {row["check"]: row["status"] for row in rows}
    assert not [row for row in rows if row["status"] == "fail"], rows
    skipped = {check for check, s in status.items() if s == "skip"}
    assert skipped == {"version cann", "version driver"} | {c for c in status if c.endswith("(bf16)")}, skipped
    collectives = [c for c in status if c.startswith("collective ")]
    assert len(collectives) == 2 * 10 + 1 and "collective tp: all_to_all_v" in collectives  # world, tp; pairs
    kernels = [c for c in status if c.startswith("kernel ") and c.endswith("(fp32)")]
    assert len(kernels) == 8 and all(status[c] == "pass" for c in kernels)
    detail = {row["check"]: row["detail"] for row in rows}
    # the recipe's attention at its per-rank shapes (tp2: 16 of the 32 heads) and the probes, refused here
    assert "16 heads (4 kv) of 128, causal" in detail["attention of qwen3_vl_8b_sft: language model"]
    assert "16 heads (16 kv) of 72" in detail["attention of qwen3_vl_8b_sft: vision, whole picture"]
    assert "refused" in detail["undocumented form: head size 72"] and '"D: Head size.' in detail[
        "undocumented form: head size 72"]
    assert "refused" in detail["undocumented form: packed TND without the causal mask"]
    launch = next(row for row in rows if row["check"] == "launch-mode self-check")
    import socket

    import mindspore

    # the verdict names the stack it holds for: this host, its CANN and driver (none here), MindSpore
    assert (f"under asynchronous launch on {socket.gethostname()} (CANN none, driver none, MindSpore "
            f"{mindspore.__version__}): runs use blocking launch (always on CPU: ") in launch["detail"], launch
    from mm_train import registry

    assert {c for c in status if c.startswith("family ")} == {f"family {name}" for name in registry.families()}


def test_a_failure_exits_non_zero_with_what_to_do(monkeypatch, capsys):
    import mindspore

    from mm_train import cli, doctor

    monkeypatch.setitem(doctor.TESTED, "mindspore", ("9.9.9",))
    assert cli.main(["doctor", "--skip-families"]) == 1
    out = capsys.readouterr().out
    assert "version mindspore" in out and f"FAIL version mindspore: {mindspore.__version__} (tested 9.9.9)" in out
    assert "what to do: install a tested MindSpore" in out
    assert "collectives  " in out and "one process: run with --nproc N >= 2" in out


@pytest.mark.parametrize("layout, want", [
    ({"tp": 2}, (4096, 8, 2)),
    ({"cp": 4, "cp_algo": "ulysses"}, (4096, 4, 1)),  # Ulysses: the whole sequence, a quarter of the heads
    ({"cp": 4, "cp_algo": "ring"}, (1024, 16, 4)),
    ({"cp": 4, "cp_algo": "hybrid", "ulysses_degree": 2, "tp": 2}, (2048, 4, 1)),
])
def test_per_rank_shapes_divide_heads_and_tokens_as_the_layout_does(layout, want):
    from mm_parallel import ParallelConfig
    from mm_train.doctor.recipe_attention import per_rank_shape
    from mm_train.plan.workload import AttentionForm

    form = AttentionForm("language model", 4096, 16, 4, 128, causal=True)
    shape = per_rank_shape(form, ParallelConfig(**layout), on_ascend=True)
    assert (shape["batch"], shape["tokens"], shape["heads"], shape["kv_heads"]) == (1,) + want
    windows = per_rank_shape(AttentionForm("vision, windows", 4096, 16, 16, 80, segment=64, split=False),
                             ParallelConfig(**layout), on_ascend=False)
    assert (windows["batch"], windows["tokens"], windows["heads"], windows["capped"]) == (2, 64, 16, True)
