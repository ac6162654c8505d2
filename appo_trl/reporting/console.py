"""What a training run logs: one canonical name per quantity, and one readable console line per step.

Metric names. The rollout engine and the tool executor both count tool calls, failures and tokens; the
trainer logs each quantity once, under one name (everything still goes to the trackers):

| quantity                                   | canonical key                         | dropped duplicates                 |
|--------------------------------------------|---------------------------------------|------------------------------------|
| tool calls executed this step (all tools)  | `tools/calls`                         | `rollout/tool_calls`, `tools/calls_per_round` |
| ... per tool (a breakdown of the total)    | `tools/<tag>/calls`                   | `rollout/tool/<tag>/calls`         |
| failed calls per tool                      | `tools/<tag>/failures`                | `rollout/tool/<tag>/failures`, `rollout/tool_failures` |
| tool time per tool                         | `tools/<tag>/latency_mean_s`, `_max_s`| `rollout/tool/<tag>/time_s`        |
| calls per completion (mean over rows)      | `tools/call_frequency` (TRL's name)   |                                    |
| tokens sampled by the policy this step     | `rollout/sampled_tokens`              | `rollout/tokens_sampled`           |

TRL's own keys (`completions/*_length`, `completions/*terminated_length`, `reward`, `step_time`, ...) keep
TRL's names.

Console. `StepLineCallback` replaces the progress bar's dict dump (`ProgressCallback.on_log`) with

    step 3/10 | reward -0.412 ±0.310 | acc 25.0% | tools 1.50/compl | branches 2.0/prompt | loss 0.0123 | 1.02 s

(with `tree_forward`, `| tree 0.31x` before the time: tokens forwarded over row-wise tokens, `tree/tokens_ratio`)

(accuracy only when a 0/1 correctness reward such as `math_verify` or `qa_em` is configured, branches
only for branching strategies; with an agent, `agent 16 req` and its errors, timeouts and restarts; for SFT,
`tok acc` is TRL's `mean_token_accuracy`). It changes the console only: `on_log` of the tracker callbacks is
untouched. In a log file (stderr not a terminal) there is no bar: the step lines, and one `ProgressLine` per 10 %
of the steps (`install_step_line`).

Long stages with no per-step line of their own (the demo's SFT cold start, a held-out evaluation) show
`ProgressLine`: at most one line every `every_s` seconds, with the rate and the time left,

      [SFT] 400/2000 steps  3.12 steps/s  ETA 8m33s  loss 1.234

so that a stage of minutes on a loaded machine never looks hung.
"""

from __future__ import annotations

import math
import re
import sys
import time

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

# engine/executor keys that repeat a quantity already logged under its canonical name
_DUPLICATE = re.compile(r"^rollout/(tool_calls|tool_failures|tokens_sampled|tool/[^/]+/(calls|failures|time_s))$")
# reward functions whose per-completion value is 1 for a correct answer and 0 otherwise
ACCURACY_REWARDS = ("math_verify", "qa_em", "accuracy", "accuracy_reward", "exact_match")


def canonical_metrics(raw: dict[str, float]) -> dict[str, float]:
    """Engine/executor metrics with the duplicates of canonical keys removed (see the module table).

    The per-tool breakdown `tools/<tag>/*` is kept even with a single tool, so the keys do not depend on how many
    tools a recipe enables (dashboards and `appo_trl.synthetic` read `tools/python/calls`).
    """
    return {k: v for k, v in raw.items() if not _DUPLICATE.match(k)}


def accuracy_of(logs: dict) -> float | None:
    """Accuracy of this step where it is known: `accuracy` if logged, else the mean of a 0/1 correctness reward."""
    for key in ("accuracy", "eval_accuracy"):
        if isinstance(logs.get(key), (int, float)):
            return float(logs[key])
    for prefix in ("", "eval_"):
        for name in ACCURACY_REWARDS:
            value = logs.get(f"{prefix}rewards/{name}/mean")
            if isinstance(value, (int, float)) and not math.isnan(value):
                return float(value)
    return None


def _num(logs: dict, key: str) -> float | None:
    value = logs.get(key)
    return float(value) if isinstance(value, (int, float)) and not math.isnan(float(value)) else None


def format_step_line(logs: dict, step: int, max_steps: int | None = None) -> str:
    """One line for one `Trainer.log` call (a training step, an evaluation, or the end-of-training summary)."""
    if "train_runtime" in logs:
        loss = _num(logs, "train_loss")
        return f"done: {step} steps in {logs['train_runtime']:.1f} s" + (
            f" | mean loss {loss:.4g}" if loss is not None else ""
        )
    prefix = "eval_" if any(k.startswith("eval_") for k in logs) else ""
    head = f"step {step}/{max_steps}" if max_steps and max_steps > 0 else f"step {step}"
    parts = [("eval " if prefix else "") + head]
    reward, std = _num(logs, f"{prefix}reward"), _num(logs, f"{prefix}reward_std")
    if reward is not None:
        parts.append(f"reward {reward:.3f}" + (f" ±{std:.3f}" if std is not None else ""))
    acc = accuracy_of(logs)
    if acc is not None:
        parts.append(f"acc {100 * acc:.1f}%")
    calls = _num(logs, f"{prefix}tools/call_frequency")
    if calls is not None:
        fail = _num(logs, f"{prefix}tools/failure_frequency")
        parts.append(f"tools {calls:.2f}/compl" + (f" (fail {100 * fail:.0f}%)" if fail else ""))
    requests = _num(logs, f"{prefix}agent/requests")  # an agent through the endpoint
    if requests is not None:
        counts = [(_num(logs, f"{prefix}agent/{key}"), key) for key in ("errors", "timeouts", "restarts")]
        parts.append(f"agent {requests:.0f} req" + "".join(f", {n:.0f} {key}" for n, key in counts if n))
    branches = _num(logs, f"{prefix}branch/points_per_prompt")
    if branches is not None:
        parts.append(f"branches {branches:.1f}/prompt")
    loss = _num(logs, f"{prefix}loss")
    if loss is not None:
        parts.append(f"loss {loss:.4g}")
    token_acc = _num(logs, f"{prefix}mean_token_accuracy")  # SFT
    if token_acc is not None:
        parts.append(f"tok acc {100 * token_acc:.1f}%")
    length = _num(logs, f"{prefix}completions/mean_length")
    if length is not None:
        parts.append(f"len {length:.0f}")
    tree = _num(logs, f"{prefix}tree/tokens_ratio")  # tree forward: tokens forwarded / row-wise tokens
    if tree is not None:
        parts.append(f"tree {tree:.2f}x")
    step_time = _num(logs, f"{prefix}step_time") or _num(logs, f"{prefix}runtime")
    if step_time is not None:
        parts.append(f"{step_time:.2f} s")
    return " | ".join(parts)


class StepLineCallback(ProgressCallback):
    """The progress bar, with one readable line per logged step instead of the metric dict."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        line = format_step_line(logs, state.global_step, state.max_steps)
        if self.training_bar is not None:
            self.training_bar.write(line)
        else:
            print(line, flush=True)


class StepLinePrinterCallback(TrainerCallback):
    """`disable_tqdm=True`: no bar, the same one line per logged step (replaces `PrinterCallback`)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            print(format_step_line(logs, state.global_step, state.max_steps), flush=True)


def install_step_line(trainer, label: str = "train", tty: bool | None = None) -> None:
    """Swap the trainer's console callback (progress bar or printer) for its one-line-per-step version.

    Not on a terminal (`tty`, default: whether stderr, where tqdm draws, is one), the bar would mix `\\r` updates into
    the log: the printer's step lines go there instead, with one `ProgressLine` (rate, ETA) per 10 % of the steps,
    and the libraries' bars are off (`quiet_progress_bars`)."""
    handler = trainer.callback_handler
    tty = sys.stderr.isatty() if tty is None else tty
    bars = [cb for cb in handler.callbacks if isinstance(cb, ProgressCallback)]
    if not tty:
        quiet_progress_bars()
    if not tty and bars:
        for cb in bars:
            trainer.remove_callback(cb)
        trainer.add_callback(StepLinePrinterCallback)
        trainer.add_callback(ProgressLineCallback(label, every_pct=10.0))
    if any(isinstance(cb, ProgressCallback) and not isinstance(cb, StepLineCallback) for cb in handler.callbacks):
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(StepLineCallback)
    if any(type(cb) is PrinterCallback for cb in handler.callbacks):
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(StepLinePrinterCallback)


def quiet_progress_bars() -> None:
    """transformers' and datasets' tqdm bars off (weight loading, shard writing, `map`): for a log file."""
    import datasets
    import transformers

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class ProgressLine:
    """One throttled progress line for a long stage: done/total, the rate since the start, and an ETA.

    `update(done)` prints when `every_s` seconds have passed since the last line (with `every_pct`: when `done`
    has reached the next multiple of `every_pct` % of `total` instead), and always for the first completed item
    and the last one (`done == total`); `note` is appended (e.g. `loss 1.234`).
    """

    def __init__(self, label: str, total: int, *, unit: str = "steps", printer=print, every_s: float = 20.0,
                 clock=time.monotonic, every_pct: float | None = None):  # fmt: skip
        self.label, self.total, self.unit, self.printer, self.every_s, self.clock = (
            label, total, unit, printer, every_s, clock)  # fmt: skip
        self.every_pct = every_pct
        self.last_pct = 0.0
        self.start = clock()
        self.last: float | None = None
        self.lines = 0

    def update(self, done: int, note: str = "") -> None:
        now = self.clock()
        if done <= 0:
            return
        if self.every_pct is not None and self.total > 0:
            pct = 100.0 * done / self.total
            quiet = self.last is not None and pct < self.last_pct + self.every_pct
            if quiet and done < self.total:
                return
            self.last_pct = pct - pct % self.every_pct
        elif done < self.total and self.last is not None and now - self.last < self.every_s:
            return
        elapsed = max(now - self.start, 1e-9)
        rate = done / elapsed
        if done >= self.total:
            when = f"done in {_duration(elapsed)}"
        else:
            when = f"ETA {_duration((self.total - done) / rate)}"
        line = f"      [{self.label}] {done}/{self.total} {self.unit}  {rate:.2f} {self.unit}/s  {when}"
        self.printer(line + (f"  {note}" if note else ""))
        self.last = now
        self.lines += 1


class ProgressLineCallback(TrainerCallback):
    """`ProgressLine` for a `Trainer` run: steps/s, ETA and the last logged loss (main process only)."""

    def __init__(self, label: str, printer=print, every_s: float = 20.0, every_pct: float | None = None):
        self.label, self.printer, self.every_s, self.every_pct = label, printer, every_s, every_pct
        self.progress: ProgressLine | None = None
        self.loss: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.progress = ProgressLine(self.label, state.max_steps, printer=self.printer, every_s=self.every_s,
                                         every_pct=self.every_pct)  # fmt: skip

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = _num(logs or {}, "loss")
        self.loss = loss if loss is not None else self.loss

    def on_step_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.update(state.global_step, f"loss {self.loss:.4g}" if self.loss is not None else "")
