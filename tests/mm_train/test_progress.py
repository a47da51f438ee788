"""The progress line: its ETA counts the steps after the run's first (warm-up) one."""


def test_the_progress_line_shows_an_eta_from_the_steps_after_the_first(capsys):
    """Plain lines (no terminal): the first step (warm-up) is not counted; then the mean step time
    times the steps left; a resumed run (its first update at step 41) counts from there."""
    from mm_train.step_rows import Progress

    times = iter([0.0, 30.0, 32.0, 34.0, 40.0])  # start, then the end of each step shown
    bar = Progress(4, True, tty=False, clock=lambda: next(times))
    bar.every = 1
    for step in (1, 2, 3, 4):
        bar.update(step, 1.0, 2.0)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("  ")[-1] for line in lines] == ["eta --", "eta 0m04s", "eta 0m02s", "done"]
    times = iter([0.0, 50.0, 53.0])
    resumed = Progress(1000, True, tty=False, clock=lambda: next(times))
    resumed.every = 1
    resumed.update(41, 1.0, 2.0)
    resumed.update(42, 1.0, 2.0)
    assert capsys.readouterr().err.splitlines()[-1].endswith("eta 47m54s")  # 3 s x 958 steps
