"""`ProgressLine`: the demo's long stages (SFT, evaluation, the study's RL runs) print rate and ETA, throttled."""

from types import SimpleNamespace

from appo_trl.reporting.console import ProgressLine, ProgressLineCallback


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_first_line_then_throttled_then_the_last_with_hand_computed_rate_and_eta():
    clock, lines = Clock(), []
    p = ProgressLine("SFT", 100, printer=lines.append, every_s=20.0, clock=clock)
    clock.t = 2.0
    p.update(1)  # the first completed step always prints: 1 / 2 s = 0.50/s, 99 left / 0.5 = 198 s
    clock.t = 10.0
    p.update(5)  # 8 s after the last line: quiet
    clock.t = 22.5
    p.update(20, "loss 1.5")  # 20.5 s after: 20 / 22.5 = 0.89/s, 80 / 0.888.. = 90 s
    clock.t = 30.0
    p.update(100)  # the last one always prints
    assert lines == [
        "      [SFT] 1/100 steps  0.50 steps/s  ETA 3m18s",
        "      [SFT] 20/100 steps  0.89 steps/s  ETA 1m30s  loss 1.5",
        "      [SFT] 100/100 steps  3.33 steps/s  done in 30s",
    ]


def test_nothing_before_the_first_item_and_hours_in_the_eta():
    clock, lines = Clock(), []
    p = ProgressLine("eval", 7200, unit="samples", printer=lines.append, clock=clock)
    p.update(0)
    clock.t = 1.0
    p.update(1)  # 7199 s left = 1 h 59 min 59 s -> "1h59m" (hours and minutes only)
    assert lines == ["      [eval] 1/7200 samples  1.00 samples/s  ETA 1h59m"]


def test_trainer_callback_shows_steps_and_the_last_logged_loss():
    lines = []
    cb = ProgressLineCallback("SFT", printer=lines.append, every_s=0.0)
    state = SimpleNamespace(is_world_process_zero=True, max_steps=2, global_step=0)
    cb.on_train_begin(None, state, None)
    state.global_step = 1
    cb.on_step_end(None, state, None)
    cb.on_log(None, state, None, logs={"loss": 2.25, "learning_rate": 1e-3})
    state.global_step = 2
    cb.on_step_end(None, state, None)
    assert [line.split("  ")[3] for line in lines] == ["[SFT] 1/2 steps", "[SFT] 2/2 steps"]
    assert "loss" not in lines[0]  # no loss logged yet at step 1
    assert lines[1].endswith("loss 2.25")


def test_only_the_main_process_prints():
    lines = []
    cb = ProgressLineCallback("SFT", printer=lines.append, every_s=0.0)
    state = SimpleNamespace(is_world_process_zero=False, max_steps=2, global_step=1)
    cb.on_train_begin(None, state, None)
    cb.on_step_end(None, state, None)
    assert lines == []
