"""`appo study`: GRPO, ARPO, AEPO and APPO on the demo's synthetic task, from one SFT checkpoint, at equal budget.

One task, model and SFT cold start (seed `--task_seed`, the demo's stages), then for every RL seed and every
strategy: `--rl_steps` steps of `recipes/demo/<strategy>.yaml` (same n, prompts per step, learning rate, tools,
reward; only the strategy block differs) and `appo eval` of the result on the same held-out questions. The
search server runs once for the whole study.

Writes `<workdir>/study.json` (everything), `<workdir>/study.md` (the table) and `<workdir>/study.png` (reward
curves, held-out accuracy, per-step sampled tokens, tool calls, rows reaching the loss, step time). Per
strategy: held-out pass@1 after K steps as mean ± sample standard deviation over seeds (and min..max), and the
per-step means. It does not tune anything per strategy and does not pick seeds. Results: docs/study.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from appo_trl.cli.demo import add_task_arguments, task_files

STRATEGIES = ("grpo", "arpo", "aepo", "appo")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="appo study", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workdir", default="outputs/study", help="where everything goes (default: %(default)s)")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="RL seeds (default: %(default)s)")
    p.add_argument("--task_seed", type=int, default=0, help="task, model and SFT seed (default: %(default)s)")
    add_task_arguments(p)
    p.add_argument("--rl_steps", type=int, default=120, help="K, RL steps per run (default: %(default)s)")
    return p


def _say(msg: str) -> None:
    print(msg, flush=True)


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    if a.rl_steps < 1 or a.sft_steps < 1 or not a.seeds:
        parser().error("--rl_steps and --sft_steps must be >= 1 and --seeds non-empty")
    run(a)
    return 0


def run(a, printer=_say) -> dict:
    from appo_trl.cli.demo import _silence_progress_bars
    from appo_trl.synthetic import pipeline as P

    _silence_progress_bars()
    P.stop_on_sigterm()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    out_json = work / "study.json"
    done = json.loads(out_json.read_text()) if out_json.is_file() else {}
    results: dict = done.get("runs", {})
    printer(f"[study] task, model and SFT (seed {a.task_seed}, {a.sft_steps} steps) -> {work}")
    paths = task_files(work, a.task_seed, a)
    sft = work / "sft"
    if not (sft / "config.json").is_file():
        P.build_model(str(work / "model"), a.task_seed)
        P.run_sft(str(work / "model"), paths["sft"], str(sft), steps=a.sft_steps, seed=a.task_seed, printer=printer)
    with P.search_server(paths["corpus"], str(work / "search_server.log")) as srv:
        if "sft" not in done:
            shutil.rmtree(work / "eval" / "sft", ignore_errors=True)  # a half-finished eval of an older server
            done["sft"] = P.evaluate_heldout(str(sft), paths["registry"], srv["url"], str(work / "eval" / "sft"),
                                             num_samples=a.eval_samples, seed=a.task_seed, printer=printer)  # fmt: skip
        printer(f"[study] SFT held-out pass@1 {100 * done['sft']['pass@1']:.1f} %")
        for seed in a.seeds:
            for strategy in a.strategies:
                key = f"{strategy}/seed{seed}"
                if key in results:  # resumed study: finished runs are kept
                    continue
                printer(f"[study] {key}: {a.rl_steps} RL steps")
                run_dir = work / "rl" / strategy / f"seed{seed}"
                args = P.rl_arguments(f"recipes/demo/{strategy}.yaml", str(sft), paths["rl"], str(run_dir),
                                      srv["url"], steps=a.rl_steps, seed=seed)  # fmt: skip
                start = time.monotonic()
                _, history = P.run_rl(args, printer=printer, label=f"RL {key}", every_s=20.0)
                rl_s = time.monotonic() - start
                shutil.rmtree(work / "eval" / strategy / f"seed{seed}", ignore_errors=True)
                ev = P.evaluate_heldout(str(run_dir), paths["registry"], srv["url"],
                                        str(work / "eval" / strategy / f"seed{seed}"),
                                        num_samples=a.eval_samples, seed=a.task_seed, printer=printer)  # fmt: skip
                results[key] = {"strategy": strategy, "seed": seed, "eval": ev, "history": history, "rl_wall_s": rl_s}
                printer(f"        held-out pass@1 {100 * ev['pass@1']:.1f} %, mean reward "
                        f"{statistics.fmean(h['reward'] for h in history):+.3f}, {rl_s:.0f} s")  # fmt: skip
                done.update(runs=results, config=vars(a))
                out_json.write_text(json.dumps(done, indent=1), encoding="utf-8")
    summary = summarize(done, a.strategies)
    done["summary"] = summary
    out_json.write_text(json.dumps(done, indent=1), encoding="utf-8")
    (work / "study.md").write_text(render(done), encoding="utf-8")
    plot(done, work / "study.png")
    printer(render(done))
    return done


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(done: dict, strategies) -> dict:
    out = {}
    for s in strategies:
        runs = [r for r in done["runs"].values() if r["strategy"] == s]
        if not runs:
            continue
        acc = [r["eval"]["pass@1"] for r in runs]

        def per_step(key, runs=runs):
            vals = [h[key] for r in runs for h in r["history"] if key in h]
            return statistics.fmean(vals) if vals else float("nan")

        out[s] = {
            "seeds": [r["seed"] for r in runs],
            "pass@1": acc,
            "pass@1_mean_sd": _mean_sd(acc),
            "pass@k_mean_sd": _mean_sd([r["eval"]["pass@k"] for r in runs]),
            "calls_per_sample_eval": statistics.fmean(r["eval"]["calls_per_sample"] for r in runs),
            "reward_mean": per_step("reward"),
            "reward_last10": statistics.fmean(h["reward"] for r in runs for h in r["history"][-10:]),
            "sampled_tokens_per_step": per_step("sampled_tokens"),
            "tool_calls_per_sample": per_step("calls"),
            "loss_rows_frac": per_step("loss_rows_frac"),
            "step_time_s": per_step("step_time"),
            "cpu_s_per_step": per_step("cpu_s"),
        }
    return out


def render(done: dict) -> str:
    sft = done["sft"]
    cfg = done.get("config", {})
    seeds = sorted({r["seed"] for r in done["runs"].values()})  # the seeds that finished
    lines = [f"SFT start: held-out pass@1 {100 * sft['pass@1']:.1f} %, pass@{sft['k']} {100 * sft['pass@k']:.1f} %",
             f"K = {cfg.get('rl_steps')} RL steps, seeds {seeds}, {sft['questions']} held-out questions "
             f"x {sft['k']} samples", "",
             "| strategy | held-out pass@1 after K (mean ± sd) | min..max | pass@k | train reward (last 10 steps) "
             "| sampled tokens / step | tool calls / sample | rows reaching the loss | step time (s) | CPU s / step |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s, v in done["summary"].items():
        m, sd = v["pass@1_mean_sd"]
        km, ksd = v["pass@k_mean_sd"]
        lines.append(
            f"| {s} | {100 * m:.1f} ± {100 * sd:.1f} % | {100 * min(v['pass@1']):.1f}..{100 * max(v['pass@1']):.1f}"
            f" | {100 * km:.1f} ± {100 * ksd:.1f} % | {v['reward_last10']:+.3f} | {v['sampled_tokens_per_step']:.0f}"
            f" | {v['tool_calls_per_sample']:.2f} | {100 * v['loss_rows_frac']:.0f} % | {v['step_time_s']:.2f}"
            f" | {v.get('cpu_s_per_step', float('nan')):.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(done: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    keys = [("reward", "training reward"), ("sampled_tokens", "sampled tokens / step"),
            ("calls", "tool calls / sample"), ("loss_rows_frac", "rows reaching the loss"),
            ("step_time", "step time (s)")]  # fmt: skip
    for i, s in enumerate(done["summary"]):
        runs = [r for r in done["runs"].values() if r["strategy"] == s]
        color = f"C{i}"
        for ax, (key, title) in zip([axes[0, 0], axes[0, 2], axes[1, 0], axes[1, 1], axes[1, 2]], keys):
            steps = sorted({h["step"] for r in runs for h in r["history"]})
            means = [statistics.fmean(h[key] for r in runs for h in r["history"] if h["step"] == t and key in h)
                     for t in steps]  # fmt: skip
            if key == "reward":
                w = 5
                means = [statistics.fmean(means[max(0, j - w + 1) : j + 1]) for j in range(len(means))]
            ax.plot(steps, means, color=color, label=s)
            ax.set(xlabel="RL step", title=title + (" (mean over seeds, 5-step window)" if key == "reward" else ""))
        accs = [100 * a for a in done["summary"][s]["pass@1"]]
        axes[0, 1].scatter([i] * len(accs), accs, color=color)
        axes[0, 1].errorbar([i], [statistics.fmean(accs)], yerr=[statistics.stdev(accs) if len(accs) > 1 else 0],
                            color="k", capsize=6, marker="_", ms=20)  # fmt: skip
    axes[0, 1].axhline(100 * done["sft"]["pass@1"], color="grey", ls="--", label="SFT start")
    axes[0, 1].set_xticks(range(len(done["summary"])), list(done["summary"]))
    axes[0, 1].set(title="held-out pass@1 after K steps (%)")
    axes[0, 1].legend()
    axes[0, 0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
