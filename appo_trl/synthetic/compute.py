"""Accuracy per unit of compute: cumulative budgets of an RL run, and accuracy at a matched budget.

The papers' claims are about cost (ARPO: about half GRPO's tool calls; Tree-GRPO: a quarter of the rollout
budget; TreePO: GPU-hours saved), so `appo study` compares strategies at equal compute as well as at equal steps.

- `BUDGETS`: the five budgets, each a per-step figure of `pipeline.StepLine.history` summed over steps:
  policy-sampled tokens, tool calls, rows reaching the loss, trainer CPU-seconds and wall seconds.
- `cumulative(history, key)`: the running sum of one budget at every step.
- `curve(run, key)`: (cumulative budget, held-out pass@1) at each evaluated step, from (0, the SFT accuracy);
  with `family`, one question family's pass@1.
- `accuracy_at(points, budget)`: linear interpolation between evaluated checkpoints; the last point's accuracy
  beyond the run's end is not extrapolated (None: the run did not reach that budget).
- `matched_budget(runs, key)`: the cheapest strategy (the smallest mean, over seeds, of the budget spent in K
  steps) and the budget where it finished: the smallest final budget of any run, so that every run of every
  strategy reached it and its accuracy there is interpolated between two evaluated checkpoints, never
  extrapolated. Each strategy's accuracy at that budget: mean and sample standard deviation over seeds.

Pure functions over the study's JSON records: nothing here runs a model.
"""

from __future__ import annotations

import statistics

BUDGETS = {
    "sampled_tokens": "policy-sampled tokens",
    "tool_calls": "tool calls",
    "loss_rows": "rows reaching the loss",
    "cpu_s": "trainer CPU-seconds",
    "wall_s": "wall seconds",
}


def cumulative(history: list[dict], key: str) -> dict[int, float]:
    """step -> the budget `key` spent up to and including that step (a missing figure counts 0)."""
    total, out = 0.0, {}
    for h in sorted(history, key=lambda h: h["step"]):
        total += float(h.get(key, 0.0))
        out[h["step"]] = total
    return out


def curve(run: dict, key: str, sft_accuracy: float, family: str | None = None) -> list[tuple[float, float]]:
    """(budget spent, held-out pass@1) at step 0 (the SFT start) and at every evaluated checkpoint of `run`.

    `run["evals"]` maps a step (int or its string, as JSON keeps it) to that checkpoint's evaluation. With
    `family`, the pass@1 of that question family (`eval["by_family"]`; `sft_accuracy` then is the SFT's on it).
    """
    spent = cumulative(run["history"], key)
    points = [(0.0, sft_accuracy)]
    for step, ev in sorted(((int(s), e) for s, e in run["evals"].items()), key=lambda x: x[0]):
        if step > 0:
            if family is not None and family not in ev.get("by_family", {}):
                raise ValueError(f"{run['strategy']} seed {run['seed']} step {step}: no pass@1 of family {family!r}")
            points.append((spent[step], ev["pass@1"] if family is None else ev["by_family"][family]))
    return points


def accuracy_at(points: list[tuple[float, float]], budget: float) -> float | None:
    """Accuracy at `budget`, linearly interpolated between the two evaluated points around it."""
    if budget > points[-1][0] + 1e-9:
        return None
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= budget <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (budget - x0) / (x1 - x0)
    return points[0][1]


def matched_budget(runs: list[dict], key: str, sft_accuracy: float, family: str | None = None,
                   budget: float | None = None) -> dict:  # fmt: skip
    """Every strategy's accuracy at the budget where the cheapest strategy finished K steps.

    `family`: that question family's pass@1 (`curve`). `budget`: compare there instead (a point fixed before the
    runs); a run that ended below it has None in `per_seed` and is left out of the mean.
    Returns {"budget", "cheapest", "strategies": {name: {"mean", "sd", "per_seed", "final_budget"}}}.
    """
    by_strategy: dict[str, list[dict]] = {}
    for r in runs:
        by_strategy.setdefault(r["strategy"], []).append(r)
    finals = {s: [max(cumulative(r["history"], key).values()) for r in rs] for s, rs in by_strategy.items()}
    cheapest = min(finals, key=lambda s: statistics.fmean(finals[s]))
    if budget is None:
        budget = min(min(f) for f in finals.values())  # every run reached it: interpolated, never extrapolated
    out = {}
    for s, rs in by_strategy.items():
        accs = [accuracy_at(curve(r, key, sft_accuracy, family), budget) for r in rs]
        reached = [a for a in accs if a is not None]
        out[s] = {
            "mean": statistics.fmean(reached) if reached else None,
            "sd": statistics.stdev(reached) if len(reached) > 1 else 0.0,
            "per_seed": accs,
            "final_budget": statistics.fmean(finals[s]),
        }
    return {"budget": budget, "cheapest": cheapest, "strategies": out}
