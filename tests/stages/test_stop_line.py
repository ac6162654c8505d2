"""The stop line starts a line of its own, also when the run stopped inside a progress bar (seen in CI: the line of
`run_interruptible` was glued to the end of an open `0%| | 0/2` bar and no longer started with `appo train`)."""

from __future__ import annotations

from tqdm import tqdm

from appo_trl.stages.interrupts import say


def test_the_stop_line_closes_open_progress_bars_first(capfd):
    bar = tqdm(total=2)  # as transformers' ProgressCallback leaves it when training raises: no newline yet
    bar.update(0)
    say("appo train: error: the server is gone; kept checkpoint-1")
    err = capfd.readouterr().err
    assert "appo train: error: the server is gone; kept checkpoint-1" in err.splitlines()
