"""`appo demo`'s `curves.png`: what the training reward averages, held-out accuracy overall and per family, tools.

Four panels, from the demo's `report.json`:

1. **training reward**: per RL step, the mean ARPO reward (`appo_trl.rewards.deep_research`: −1 for a bad format,
   else the token-F1 of the boxed answer, +0.1 with both tools) over the step's sampled rows: 4 RL prompts x 4
   rows, APPO's branch rows included, on the training prompts of that step (a different mix of families each
   step), and its mean over full windows of steps. Beside it, the same quantity on the held-out split at each
   evaluated checkpoint (every held-out sample scored by the same reward), so "the reward fell" on a step's
   prompts can be read against the held-out reward.
2. **held-out accuracy**: pass@1 and pass@k at the checkpoints (step 0 = the SFT start).
3. **held-out pass@1 per family** (python, search, both): a family that falls while the total rises shows here.
4. **tool calls per sample**: training rollouts per step, held-out samples at the checkpoints.
"""

from __future__ import annotations

import os

REWARD_DEFINITION = "mean ARPO reward per sample\n(-1 bad format, else F1 of the box, +0.1 both tools)"


def moving_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last `window` values at each position (fewer at the start)."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
            for i in range(len(values))]  # fmt: skip


def family_series(report: dict) -> dict[str, tuple[list[int], list[float]]]:
    """Held-out pass@1 per family: family -> (checkpoint steps, pass@1 in %), steps ascending."""
    evals = sorted((int(s), v) for s, v in report["eval"].items())
    out: dict[str, tuple[list[int], list[float]]] = {}
    for step, ev in evals:
        for family, acc in sorted(ev.get("by_family", {}).items()):
            steps, accs = out.setdefault(family, ([], []))
            steps.append(step)
            accs.append(100 * acc)
    return out


def plot_curves(report: dict, path: str | os.PathLike) -> dict[str, list[str]]:
    """Draw the four panels into `path`; returns each panel's title and the labels of the lines drawn in it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = report["rl_history"]
    steps = [h["step"] for h in hist]
    ev = sorted((int(s), v) for s, v in report["eval"].items())
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.4))
    titles = ["training reward", "held-out accuracy", "held-out pass@1 per family", "tool calls"]
    rewards = [h["reward"] for h in hist]
    w = max(1, len(rewards) // 8)
    ax = axes[0]
    ax.plot(steps, rewards, color="tab:blue", alpha=0.3, label="training rows, per step")
    # full windows only: a "mean" of the first step alone read as a reward that fell from there (issue 49)
    ax.plot(steps[w - 1 :], moving_mean(rewards, w)[w - 1 :], color="tab:blue",
            label=f"training rows, mean of last {w} steps")  # fmt: skip
    scored = [(s, v["reward"]) for s, v in ev if v.get("reward") is not None]
    if scored:
        ax.plot([s for s, _ in scored], [r for _, r in scored], marker="o", color="tab:red",
                label="held-out samples, same reward")  # fmt: skip
    ax.set(xlabel="RL step (0 = SFT)", ylabel=REWARD_DEFINITION, title=titles[0])
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.plot([s for s, _ in ev], [100 * v["pass@1"] for _, v in ev], marker="o", label="pass@1")
    ax.plot([s for s, _ in ev], [100 * v["pass@k"] for _, v in ev], marker="s", ls="--", label=f"pass@{report['k']}")
    ax.set(xlabel="RL step (0 = SFT)", ylabel="held-out accuracy (%)", title=titles[1], ylim=(0, 100))
    ax.legend(fontsize=8)
    ax = axes[2]
    for family, (fs, accs) in family_series(report).items():
        ax.plot(fs, accs, marker="o", label=family)
    ax.set(xlabel="RL step (0 = SFT)", ylabel="held-out pass@1 (%)", title=titles[2], ylim=(0, 100))
    ax.legend(fontsize=8)
    ax = axes[3]
    ax.plot(steps, [h.get("calls", 0) for h in hist], color="tab:green", label="training rollouts")
    ax.plot([s for s, _ in ev], [v["calls_per_sample"] for _, v in ev], marker="o", color="tab:olive",
            label="held-out eval")  # fmt: skip
    ax.set(xlabel="RL step", ylabel="tool calls / sample", title=titles[3])
    ax.legend(fontsize=8)
    fig.suptitle(f"appo demo: {report['strategy']} on the synthetic tool task, seed {report['seed']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    drawn = {ax.get_title(): [line.get_label() for line in ax.get_lines()] for ax in axes}
    plt.close(fig)
    return drawn
