"""The collective watchdog (in process): a wait past the timeout reports the waiting rank, the
collective, the step and — from the heartbeats — the peer that made fewer collectives; a wait
inside `paused()` or shorter than the timeout reports nothing."""

import json
import time

import pytest

from mm_parallel.comm import watchdog as wd


def wait_in_collective(seconds, ranks=(0, 1)):
    wd.watched("all_reduce", ranks, time.sleep, seconds)


def test_a_long_wait_names_the_rank_that_never_came(tmp_path):
    reports = []
    wd.set_step(7)
    peer = {"rank": 1, "time": time.time(), "step": 7, "counts": {"0,1": 0}, "current": None,
            "last": "all_gather over ranks [0,1]"}
    (tmp_path / "rank_1.json").write_text(json.dumps(peer))
    made = wd.ACTIVITY.counts.get("0,1", 0)
    with wd.Watchdog(0, timeout=0.3, heartbeat_dir=str(tmp_path), on_hang=reports.append, interval=0.05):
        wait_in_collective(0.8)
    assert len(reports) == 1, reports
    report = reports[0]
    assert report.startswith("rank 0 waited 0 s (collective timeout 0 s) in all_reduce over ranks [0,1] at step 7, "
                             f"its collective #{made + 1} on that group")
    assert "rank 1 stopped entering collectives: it made 0 on that group, is at step 7 in no collective (its last: " \
           "all_gather over ranks [0,1])" in report
    beat = json.loads((tmp_path / "rank_0.json").read_text())  # its own heartbeat, for the others' reports
    assert beat["rank"] == 0 and beat["step"] == 7 and beat["counts"]["0,1"] == made + 1


def test_short_or_paused_waits_report_nothing(tmp_path):
    reports = []
    dog = wd.Watchdog(0, timeout=0.4, on_hang=reports.append, interval=0.05).start()
    wait_in_collective(0.1)
    with dog.paused():
        wait_in_collective(0.7)
    time.sleep(0.2)
    dog.stop()
    assert reports == [] and wd.ACTIVITY.current is None
    with pytest.raises(ValueError, match="positive seconds"):
        wd.Watchdog(0, timeout=0)
