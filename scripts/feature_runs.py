"""Run the demo's feature recipes one after the other on the cold start; say how each one's training reward moved.

    python scripts/feature_runs.py [--recipes lora tree agent async] [--window 10] [--out outputs/feature_runs.json]
    python scripts/feature_runs.py --heldout sft lora tree async [--samples 2]   # after the runs

Needs the cold start (`make cold-start`). Each recipe runs as `appo train --config recipes/demo/<name>.yaml` in a
child process, one at a time. Per run: wall time, the child's CPU seconds (user + system, its own children
included), the 1-minute load average before and after (the machine is shared: say so next to the figures), and from
its `trainer_state.json` the mean and sample sd of the per-step training reward over the first and over the last
`window` steps (`window_stats`), and the same for tool calls per completion. Nothing is tuned here: the settings
are the recipes'. `--heldout` evaluates the cold start (`sft`) and the runs' final models on the cold start's 96
held-out questions (`appo_trl.synthetic.pipeline.evaluate_heldout`: `--samples` each at temperature 1, seed 0, the
real python sandbox and `appo serve-search`), the training reward being too noisy at 16 rows a step. Figures: README, "Features on the cold start"; docs/benchmarks.md, "Features on the cold start".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def window_stats(values: list[float], window: int) -> dict[str, float]:
    """Mean and sample sd of the first and the last `window` values, and the change of the means (last - first)."""
    if window < 2 or len(values) < 2 * window:
        raise ValueError(f"need at least {2 * window} values for two windows of {window} (>= 2), got {len(values)}")
    first, last = values[:window], values[-window:]
    out = {"first_mean": statistics.fmean(first), "first_sd": statistics.stdev(first),
           "last_mean": statistics.fmean(last), "last_sd": statistics.stdev(last)}  # fmt: skip
    out["change"] = out["last_mean"] - out["first_mean"]
    return out


def run_one(name: str, window: int) -> dict:
    recipe = REPO / "recipes" / "demo" / f"{name}.yaml"
    out_dir = REPO / "outputs" / f"demo-{name}"
    log = REPO / "outputs" / f"feature-{name}.log"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0, t0 = os.getloadavg()[0], time.monotonic()
    with open(log, "w") as fh:
        code = subprocess.call([sys.executable, "-m", "appo_trl.cli", "train", "--config", str(recipe),
                                "--output_dir", str(out_dir)], stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)  # fmt: skip
    wall, after = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if code != 0:
        raise SystemExit(f"appo train --config {recipe} exited with {code}; see {log}")
    history = json.loads((out_dir / "trainer_state.json").read_text())["log_history"]
    steps = [h for h in history if "reward" in h]
    return {"recipe": str(recipe.relative_to(REPO)), "steps": len(steps), "wall_s": round(wall, 1),
            "cpu_s": round(cpu, 1), "load_before": load0, "load_after": os.getloadavg()[0],
            "reward": window_stats([h["reward"] for h in steps], window),
            "tool_calls_per_completion": window_stats([h.get("tools/call_frequency", 0.0) for h in steps], window),
            "log": str(log.relative_to(REPO))}  # fmt: skip


def heldout(names: list[str], samples: int, out: str) -> None:
    """Held-out pass@1 / pass@k / tool calls per sample of `outputs/demo/sft` (`sft`) or `outputs/demo-<name>`."""
    from appo_trl.synthetic import pipeline as P

    data = REPO / "outputs" / "demo" / "data"
    results = json.loads(Path(out).read_text()) if Path(out).is_file() else {}
    with P.search_server(str(data / "corpus.jsonl"), str(REPO / "outputs" / "feature-search.log")) as srv:
        for name in names:
            model = REPO / "outputs" / ("demo/sft" if name == "sft" else f"demo-{name}")
            t0 = time.monotonic()
            r = P.evaluate_heldout(str(model), str(data / "benchmarks.yaml"), srv.url,
                                   str(REPO / "outputs" / "feature-eval" / name), num_samples=samples, seed=0)  # fmt: skip
            r["wall_s"], r["load"] = round(time.monotonic() - t0, 1), os.getloadavg()[0]
            results.setdefault("heldout", {})[name] = r
            print(f"{name:6} held-out pass@1 {100 * r['pass@1']:.1f} %  pass@{r['k']} {100 * r['pass@k']:.1f} %  "
                  f"tool calls/sample {r['calls_per_sample']:.2f}  by family {r['by_family']}", flush=True)  # fmt: skip
            Path(out).write_text(json.dumps(results, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", default=["lora", "tree", "agent", "async"])
    p.add_argument("--window", type=int, default=10, help="steps averaged at the start and at the end")
    p.add_argument("--out", default="outputs/feature_runs.json")
    p.add_argument("--heldout", nargs="+", help="evaluate these (sft = the cold start) instead of training")
    p.add_argument("--samples", type=int, default=2, help="samples per held-out question (--heldout)")
    a = p.parse_args(argv)
    if a.heldout:
        heldout(a.heldout, a.samples, a.out.replace(".json", "_heldout.json"))
        return 0
    if not (REPO / "outputs" / "demo" / "sft" / "config.json").is_file():
        p.error("no cold start in outputs/demo/sft: run `make cold-start` (appo demo --sft_only) first")
    results = {}
    for name in a.recipes:
        r = results[name] = run_one(name, a.window)
        w = r["reward"]
        print(f"{name:6} reward {w['first_mean']:+.3f} ±{w['first_sd']:.3f} (steps 1-{a.window}) -> "
              f"{w['last_mean']:+.3f} ±{w['last_sd']:.3f} (last {a.window}), {r['wall_s']:.0f} s wall, "
              f"{r['cpu_s']:.0f} CPU-s, load {r['load_before']:.1f} -> {r['load_after']:.1f}", flush=True)  # fmt: skip
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
