"""The console in a log file and for SFT and agents (issue 49): no tqdm bar when stderr is not a terminal but the
step lines and one progress line per 10 %, SFT's token accuracy, and the agent's requests and failures on the line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from appo_trl.reporting.console import (
    ProgressLine,
    ProgressLineCallback,
    StepLineCallback,
    StepLinePrinterCallback,
    format_step_line,
    install_step_line,
)


def test_agent_metrics_reach_the_step_line():
    logs = {"reward": 0.5, "agent/requests": 16.0, "agent/errors": 2.0, "agent/timeouts": 1.0, "agent/restarts": 0.0}
    assert format_step_line(logs, 2, 4) == "step 2/4 | reward 0.500 | agent 16 req, 2 errors, 1 timeouts"
    logs = {"reward": 1.0, "agent/requests": 8.0, "agent/errors": 0.0, "agent/restarts": 3.0}
    assert format_step_line(logs, 1) == "step 1 | reward 1.000 | agent 8 req, 3 restarts"
    assert "agent" not in format_step_line({"reward": 1.0, "tools/call_frequency": 1.0}, 1)  # no agent: no part


def test_sft_logs_read_as_one_line():
    logs = {"loss": 5.9421, "grad_norm": 3.1, "learning_rate": 1e-3, "mean_token_accuracy": 0.1834, "epoch": 0.5}
    assert format_step_line(logs, 3, 4) == "step 3/4 | loss 5.942 | tok acc 18.3%"


@pytest.fixture(autouse=True)
def bars_back():
    """`install_step_line(tty=False)` turns the libraries' bars off process-wide: on again after each test."""
    yield
    import datasets
    import transformers

    transformers.utils.logging.enable_progress_bar()
    datasets.enable_progress_bars()


class Trainer:
    def __init__(self, *callbacks):
        self.callback_handler = SimpleNamespace(callbacks=list(callbacks))

    def remove_callback(self, cb):
        handler = self.callback_handler.callbacks
        handler.remove(next(c for c in handler if c is cb or (isinstance(cb, type) and isinstance(c, cb))))

    def add_callback(self, cb):
        self.callback_handler.callbacks.append(cb() if isinstance(cb, type) else cb)


def _kinds(trainer):
    return [type(cb) for cb in trainer.callback_handler.callbacks]


def test_a_terminal_keeps_the_bar_with_step_lines():
    trainer = Trainer(ProgressCallback())
    install_step_line(trainer, tty=True)
    assert _kinds(trainer) == [StepLineCallback]


def test_a_log_file_gets_no_bar_but_step_lines_and_a_line_per_ten_percent():
    trainer = Trainer(ProgressCallback())
    install_step_line(trainer, label="SFT", tty=False)
    assert _kinds(trainer) == [StepLinePrinterCallback, ProgressLineCallback]
    progress = trainer.callback_handler.callbacks[1]
    assert progress.label == "SFT" and progress.every_pct == 10.0
    import transformers

    assert not transformers.utils.logging.is_progress_bar_enabled()  # nor weight-loading bars in the log
    trainer = Trainer(PrinterCallback())  # disable_tqdm: the printer's line, as before
    install_step_line(trainer, tty=False)
    assert _kinds(trainer) == [StepLinePrinterCallback]


def test_progress_line_every_ten_percent_hand_counted():
    lines = []
    p = ProgressLine("train", 45, printer=lines.append, every_pct=10.0, clock=lambda: 1.0)
    for done in range(1, 46):
        p.update(done)
    # the first step, then each step that reaches the next multiple of 10 % of 45 (4.5 steps): 5 (11.1 %),
    # 9 (20.0 %), 14 (31.1 %), 18 (40.0 %), 23 (51.1 %), 27 (60 %), 32 (71.1 %), 36 (80 %), 41 (91.1 %), and the last
    assert [int(line.split()[1].split("/")[0]) for line in lines] == [1, 5, 9, 14, 18, 23, 27, 32, 36, 41, 45]
