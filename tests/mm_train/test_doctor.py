"""`mm-train doctor` on this CPU with 2 processes: every check runs and passes or says why it is
skipped (CANN, driver and bf16 kernels are Ascend's), JSON and table carry the same rows, and a
failure exits non-zero with what to do."""

import json
import subprocess

import pytest
from helpers.mm_train_cli import mm_train_command

pytestmark = pytest.mark.distributed


def test_the_doctor_passes_on_two_cpu_processes(tmp_path):
    result = subprocess.run([mm_train_command(), "doctor", "--nproc", "2", "--json"], capture_output=True,
                            text=True, timeout=900, cwd=tmp_path)
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
    launch = next(row for row in rows if row["check"] == "launch-mode self-check")
    assert "under asynchronous launch: runs use blocking launch (always on CPU: " in launch["detail"], launch
    from mm_train import registry

    assert {c for c in status if c.startswith("family ")} == {f"family {name}" for name in registry.families()}


def test_a_failure_exits_non_zero_with_what_to_do(monkeypatch, capsys):
    from mm_train import cli, doctor

    monkeypatch.setitem(doctor.SUPPORTED, "mindspore", "9.9.9")
    assert cli.main(["doctor", "--skip-families"]) == 1
    out = capsys.readouterr().out
    assert "version mindspore" in out and "FAIL version mindspore: 2.7.2 (supported 9.9.9)" in out
    assert "what to do: install the supported versions" in out
    assert "collectives  " in out and "one process: run with --nproc N >= 2" in out
