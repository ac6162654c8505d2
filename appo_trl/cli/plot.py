"""`appo plot OUTPUT_DIR [--out FILE.png]`: training curves from `trainer_state.json`, drawn with matplotlib.

Reads the log history the Trainer writes (`OUTPUT_DIR/trainer_state.json`, else the newest
`checkpoint-N/trainer_state.json`; a path to the json itself also works) and draws one panel per quantity
that was logged: reward (± its group std, and the eval reward when there is one), accuracy (where a 0/1
correctness reward or an `accuracy` metric was logged), tool calls per completion, branch points per prompt,
loss and step time. The PNG goes to `OUTPUT_DIR/training_curves.png` unless `--out` says otherwise.

What this does not do: smooth the curves, or read tracker logs (wandb, trackio, tensorboard have their own UIs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# panel title -> (key in a log entry, or a function of the entry)
PANELS = (
    ("reward", "reward"),
    ("accuracy", "accuracy"),
    ("tool calls / completion", "tools/call_frequency"),
    ("branch points / prompt", "branch/points_per_prompt"),
    ("loss", "loss"),
    ("step time (s)", "step_time"),
)


def find_trainer_state(path: str | Path) -> Path:
    """`trainer_state.json` for an output folder, a checkpoint folder, or the file itself."""
    path = Path(path)
    if path.is_file():
        return path
    if (path / "trainer_state.json").is_file():
        return path / "trainer_state.json"
    checkpoints = sorted(path.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[-1]))
    if checkpoints:
        return checkpoints[-1]
    raise FileNotFoundError(
        f"No trainer_state.json in {path} (nor in a checkpoint-N folder): is it the output_dir of a finished or "
        "checkpointed `appo train` run?"
    )


def series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one quantity over the training log entries (eval entries use `eval_<key>`)."""
    from appo_trl.reporting.console import accuracy_of

    steps, values = [], []
    for entry in history:
        if "step" not in entry:
            continue
        value = accuracy_of(entry) if key == "accuracy" else entry.get(key)
        if isinstance(value, (int, float)):
            steps.append(int(entry["step"]))
            values.append(float(value))
    return steps, values


def plot_training_curves(history: list[dict], out: str | Path, title: str = "") -> list[str]:
    """Draw the panels that have data into `out` (PNG); returns the panel titles drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    train = [e for e in history if not any(k.startswith("eval_") for k in e)]
    evals = [
        {k.removeprefix("eval_"): v for k, v in e.items()} for e in history if any(k.startswith("eval_") for k in e)
    ]
    panels = [(name, key) for name, key in PANELS if series(train, key)[0] or series(evals, key)[0]]
    if not panels:
        raise ValueError("the log history has none of: " + ", ".join(k for _, k in PANELS))
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (name, key) in zip(axes.flat, panels):
        steps, values = series(train, key)
        if steps:
            ax.plot(steps, values, marker="o", markersize=3, label="train")
        if key == "reward":
            s_std, std = series(train, "reward_std")
            if s_std == steps and std:
                ax.fill_between(steps, [v - s for v, s in zip(values, std)], [v + s for v, s in zip(values, std)],
                                alpha=0.2, label="± group std")  # fmt: skip
        e_steps, e_values = series(evals, key)
        if e_steps:
            ax.plot(e_steps, e_values, marker="s", markersize=4, linestyle="--", label="eval")
        ax.set(title=name, xlabel="step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if e_steps or key == "reward":
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [name for name, _ in panels]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appo plot", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("output_dir", help="output_dir of an `appo train` run (or a checkpoint, or trainer_state.json)")
    p.add_argument("--out", default=None, help="PNG to write (default: OUTPUT_DIR/training_curves.png)")
    a = p.parse_args(argv)
    try:
        state_path = find_trainer_state(a.output_dir)
        history = json.loads(state_path.read_text())["log_history"]
        base = Path(a.output_dir) if Path(a.output_dir).is_dir() else state_path.parent
        out = Path(a.out) if a.out else base / "training_curves.png"
        drawn = plot_training_curves(history, out, title=str(a.output_dir))
    except (FileNotFoundError, ValueError, KeyError, json.JSONDecodeError) as exc:
        print(f"appo plot: {exc}", file=sys.stderr)
        return 2
    print(f"{out}: {', '.join(drawn)} over {len(history)} log entries (from {state_path})")
    return 0
