"""`appo study`: GRPO, ARPO, AEPO and APPO on the demo's synthetic task, from one SFT checkpoint, at equal steps
and at equal compute.

One task, model and SFT cold start (seed `--task_seed`, the demo's stages), then for every RL seed and every
variant: `--rl_steps` steps of `recipes/demo/<strategy>.yaml` (same n, prompts per step, learning rate, tools,
reward; only the strategy block differs), with `appo eval` of the held-out questions at `--checkpoints`
intermediate checkpoints and at the end. The search server runs once for the whole study.

Per step every run records the budgets of `appo_trl.synthetic.compute`: policy-sampled tokens, tool calls, rows
reaching the loss, trainer CPU-seconds and wall seconds. The report has three tables: held-out pass@1 after K
steps (mean ± sample sd over seeds, min..max), pass@1 at matched budgets (each strategy's accuracy at the budget
where the cheapest strategy finished K steps, linearly interpolated between its evaluated checkpoints; see
`compute.matched_budget`), and pass@1 per question family.

- quick (the default, `make study`): n = 4 with 2 initial rollouts, the demo's three families.
- `--full`: the papers' shape, n = 16 with 8 initial rollouts (GRPO at n = 16), the chain family added (3-5
  dependent calls; tool-call limit 5, completions up to 384 tokens, SFT traces up to 512), and each `reference:`
  preset beside our defaults (`arpo+ref`, `aepo+ref`, `appo+ref`), and tree credit (`arpo+tree`, `aepo+tree`,
  `appo+tree`: `advantage_estimator: tree`, the TreeRL paper's equations), and the released tree estimators on
  ARPO's recipe (`arpo+treerl`: `tree_credit_form: treerl_released`; `arpo+treegrpo`: `advantage_estimator:
  tree_grpo` with Tree-GRPO's random expansion, `entropy_weight: 0`). Far longer; it resumes from `study.json`,
  so it can run in parts.

With the chain family, a fourth table says where the chain questions fail (`appo_trl.synthetic.chain_errors`).

Writes `<workdir>/study.json` (everything), `<workdir>/study.md` (the tables), `<workdir>/study.png` (curves
over steps) and `<workdir>/study_compute.png` (held-out pass@1 against each budget). It does not tune
anything per variant and does not pick seeds: one learning rate for all, the recipes'. Results: docs/study.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from appo_trl.cli.demo import add_task_arguments, task_files
from appo_trl.synthetic.task import ALL_FAMILIES, FAMILIES

STRATEGIES = ("grpo", "arpo", "aepo", "appo")
REFERENCES = ("arpo+ref", "aepo+ref", "appo+ref")  # `reference: <algo>` on the same recipe
TREE = ("arpo+tree", "aepo+tree", "appo+tree")  # `advantage_estimator: tree` on the same recipe (tree credit)
# the released tree estimators on ARPO's recipe (docs/fidelity.md, Tree credit; docs/study.md section 3.4)
RELEASED_TREE = ("arpo+treerl", "arpo+treegrpo")
# the overrides of each: TreeRL's released estimator and script options (ARPO's sampling: TreeRL's EPTree sampler
# is not one of ours); Tree-GRPO's estimator (`adv_estimator=tree`: group z-score + tree z-score) and its sampler
# as ARPO's engine expresses it, `expand_mode=random` (fork after a tool result with P = branch_probability, no
# entropy term). Everything else, the loss included, is the recipe's, as for every variant.
RELEASED_TREE_OVERRIDES = {
    "treerl": ["--advantage_estimator", "tree", "--tree_credit_form", "treerl_released"],
    "treegrpo": ["--advantage_estimator", "tree_grpo", "--tree_grpo_combine", "sum", "--entropy_weight", "0.0"],
}
# --full: the papers' group shape and the long chains
# A 5-call chain solution is up to 295 completion tokens (tool results included) and 424 with its prompt
# (`tests/test_study.py` checks both against the generated traces), so neither budget truncates one.
FULL = {
    "num_generations": 16,
    "initial_rollouts": 8,
    "tool_call_limit": 5,
    "max_completion_length": 384,
    "sft_max_length": 512,
}
CHAIN_BUDGETS = ("tool_call_limit", "max_completion_length", "sft_max_length")  # whenever the chain family is in
# --full's cold start: the chain traces make its data longer and harder, and at the demo's 2,000 steps and lr 3e-3
# it solved no chain; measured in docs/study.md section 3.2.
# Both keep the constant learning rate their measured tables ran with (the demo's cold start now decays it).
FULL_SFT = {"sft_steps": 4000, "sft_lr": 1e-3, "sft_schedule": "constant_with_warmup"}
QUICK_SFT = {"sft_steps": 2000, "sft_lr": 3e-3, "sft_schedule": "constant_with_warmup"}


def _recipe(strategy: str) -> dict:
    """`recipes/demo/<strategy>.yaml` as a dict."""
    import yaml

    from appo_trl.configs.recipes import REPO_ROOT

    return yaml.safe_load((REPO_ROOT / "recipes" / "demo" / f"{strategy}.yaml").read_text()) or {}


def variant_overrides(variant: str, a) -> list[str]:
    """Command-line overrides of `recipes/demo/<strategy>.yaml` for one variant of the study."""
    out = []
    strategy, _, suffix = variant.partition("+")
    if suffix == "tree":  # TreeRL's default weights and scaling, fixed before any run (appo: branch rows trained)
        out += ["--advantage_estimator", "tree"]
    out += RELEASED_TREE_OVERRIDES.get(suffix, [])
    if suffix == "ref":
        from appo_trl.configs.reference import REFERENCE_PRESETS

        out += ["--reference", strategy]
        recipe = _recipe(strategy)
        for name, value in REFERENCE_PRESETS[strategy].items():  # the recipe's own differences yield to the preset
            if name in recipe and recipe[name] != value:
                out += [f"--{name}", str(value)]
    recipe_beta = _recipe(strategy).get("beta", 0.0)
    if float(recipe_beta) != a.beta:  # one KL weight for every variant (recipes/demo/appo.yaml has its own)
        out += ["--beta", str(a.beta)]
    if a.num_generations:
        out += ["--num_generations", str(a.num_generations), "--per_device_train_batch_size",
                str(a.num_generations * a.prompts_per_step)]  # fmt: skip
        from appo_trl.strategies import STRATEGIES

        if STRATEGIES[strategy].branches:
            out += ["--initial_rollouts", str(a.initial_rollouts)]
    if a.tool_call_limit:
        out += ["--tool_call_limit", str(a.tool_call_limit)]
    if a.max_completion_length:
        out += ["--max_completion_length", str(a.max_completion_length)]
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="appo study", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workdir", default="outputs/study", help="where everything goes (default: %(default)s)")
    p.add_argument(
        "--strategies",
        nargs="+",
        default=None,
        choices=STRATEGIES + REFERENCES + TREE + RELEASED_TREE,
        help="variants to run (default: the four strategies; with --full also the reference presets, tree credit and "
        "the released tree estimators)",
    )
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="RL seeds (default: %(default)s)")
    p.add_argument("--task_seed", type=int, default=0, help="task, model and SFT seed (default: %(default)s)")
    add_task_arguments(p)
    steps = next(x for x in p._actions if x.dest == "sft_steps")
    steps.default, steps.help = None, "SFT cold-start steps (default: {} with --full, else {})".format(
        FULL_SFT["sft_steps"], QUICK_SFT["sft_steps"])  # fmt: skip
    p.add_argument("--sft_lr", type=float, default=None, help="SFT learning rate (default: {} with --full, else {})"
                   .format(FULL_SFT["sft_lr"], QUICK_SFT["sft_lr"]))  # fmt: skip
    schedule = next(x for x in p._actions if x.dest == "sft_schedule")
    schedule.default, schedule.help = None, "SFT learning-rate schedule (default: constant_with_warmup, as measured)"
    p.add_argument("--rl_steps", type=int, default=120, help="K, RL steps per run (default: %(default)s)")
    p.add_argument("--checkpoints", type=int, default=2, help="held-out evaluations during each run, besides the "
                   "one at the end (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--families",
        nargs="+",
        default=None,
        choices=ALL_FAMILIES,
        help=f"question families (default: {' '.join(FAMILIES)}; with --full also chain)",
    )
    p.add_argument("--full", action="store_true", help="the papers' shape: " + ", ".join(f"{k} {v}" for k, v in
                   FULL.items()) + ", the chain family and the reference presets")  # fmt: skip
    for key in FULL:
        p.add_argument(f"--{key}", type=int, default=None, help=f"override (--full: {FULL[key]})" + (
            ", also the default with the chain family" if key in CHAIN_BUDGETS else ""))  # fmt: skip
    p.add_argument("--prompts_per_step", type=int, default=4, help="prompts per RL step (default: %(default)s)")
    p.add_argument("--beta", type=float, default=0.0, help="the KL weight of every variant, one value for all "
                   "(default: %(default)s, as docs/study.md was measured; the demo's APPO recipe has its own)")  # fmt: skip
    return p


def _fill(a, defaults: dict) -> None:
    """Set each of `defaults` that the command line left unset."""
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)


def resolve(a):
    """Fill the defaults that depend on --full and on the families."""
    if a.full:
        _fill(a, FULL)
    _fill(a, FULL_SFT if a.full else QUICK_SFT)
    a.strategies = a.strategies or list(STRATEGIES + (REFERENCES + TREE + RELEASED_TREE if a.full else ()))
    a.families = a.families or list(FAMILIES + (("chain",) if a.full else ()))
    if "chain" in a.families:  # the chains' budgets, also in a quick study that adds the family
        _fill(a, {key: FULL[key] for key in CHAIN_BUDGETS})
    return a


CHAIN_MATCHED = "chain_sampled_tokens"  # `matched`: the chain family's pass@1 at matched policy-sampled tokens
RESUMABLE = ("workdir", "strategies", "seeds")  # what a resumed study may change: which runs it adds
# settings added after a study.json could have been written, with the value every such study ran with
ADDED = {"sft_schedule": "constant_with_warmup", "beta": 0.0}


def check_resume(done: dict, a, path) -> None:
    """Refuse to resume a study whose `study.json` was made with other settings: its finished runs would be
    kept beside runs of a different task, cold start or budget, and the tables would mix them."""
    from appo_trl.configs.errors import ConfigError

    old = done.get("config")
    if old is None:
        return
    old = {**ADDED, **old}
    changed = [f"{k} {old.get(k)!r} -> {v!r}" for k, v in vars(a).items() if k not in RESUMABLE and old.get(k) != v]
    if changed:
        raise ConfigError(f"{path} was made with other settings ({'; '.join(changed)}); resuming would mix them "
                          "in one table: use another --workdir or the same settings")  # fmt: skip


def _say(msg: str) -> None:
    print(msg, flush=True)


def main(argv: list[str]) -> int:
    a = resolve(parser().parse_args(argv))
    if a.rl_steps < 1 or a.sft_steps < 1 or not a.seeds or a.checkpoints < 0:
        parser().error("--rl_steps and --sft_steps must be >= 1, --checkpoints >= 0 and --seeds non-empty")
    if a.num_generations and a.initial_rollouts and not 0 < a.initial_rollouts <= a.num_generations:
        parser().error("--initial_rollouts must be in 1..--num_generations")
    run(a)
    return 0


def run(a, printer=_say) -> dict:
    from appo_trl.cli.demo import _silence_progress_bars
    from appo_trl.synthetic import pipeline as P

    a = resolve(a)
    _silence_progress_bars()
    P.stop_on_sigterm()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    out_json = work / "study.json"
    done = json.loads(out_json.read_text()) if out_json.is_file() else {}
    check_resume(done, a, out_json)
    results: dict = done.get("runs", {})
    printer(f"[study] task, model and SFT (seed {a.task_seed}, {a.sft_steps} steps, families {a.families}) -> {work}")
    paths = task_files(work, a.task_seed, a)
    sft = work / "sft"
    if not (sft / "config.json").is_file():
        P.build_model(str(work / "model"), a.task_seed)
        P.run_sft(
            str(work / "model"),
            paths["sft"],
            str(sft),
            steps=a.sft_steps,
            seed=a.task_seed,
            lr=a.sft_lr,
            schedule=a.sft_schedule,
            max_length=a.sft_max_length,
            printer=printer,
        )
    eval_kw = {
        "num_samples": a.eval_samples,
        "seed": a.task_seed,
        "printer": printer,
        "call_limit": a.tool_call_limit or 3,
        "max_completion_length": a.max_completion_length or 128,
    }
    every = max(1, a.rl_steps // (a.checkpoints + 1))
    save_steps = [every * (i + 1) for i in range(a.checkpoints) if every * (i + 1) < a.rl_steps]
    with P.search_server(paths["corpus"], str(work / "search_server.log")) as srv:
        if "sft" not in done:
            shutil.rmtree(work / "eval" / "sft", ignore_errors=True)  # a half-finished eval of an older server
            done["sft"] = P.evaluate_heldout(str(sft), paths["registry"], srv.url, str(work / "eval" / "sft"),
                                             **eval_kw)  # fmt: skip
        printer(f"[study] SFT held-out pass@1 {100 * done['sft']['pass@1']:.1f} %")
        for seed in a.seeds:
            for variant in a.strategies:
                key = f"{variant}/seed{seed}"
                if key in results:  # resumed study: finished runs are kept
                    continue
                printer(f"[study] {key}: {a.rl_steps} RL steps, held-out evaluations at {[*save_steps, a.rl_steps]}")
                run_dir = work / "rl" / variant / f"seed{seed}"
                args = P.rl_arguments(f"recipes/demo/{variant.partition('+')[0]}.yaml", str(sft), paths["rl"],
                                      str(run_dir), srv.url, steps=a.rl_steps, seed=seed,
                                      overrides=variant_overrides(variant, a))  # fmt: skip
                start = time.monotonic()
                _, history = P.run_rl(args, save_steps=save_steps, printer=printer, label=f"RL {key}", every_s=20.0)
                rl_s = time.monotonic() - start
                evals = {}
                for step in [*save_steps, a.rl_steps]:
                    model = run_dir / f"checkpoint-{step}" if step < a.rl_steps else run_dir
                    out = work / "eval" / variant / f"seed{seed}" / f"step{step}"
                    shutil.rmtree(out, ignore_errors=True)
                    evals[str(step)] = P.evaluate_heldout(str(model), paths["registry"], srv.url, str(out),
                                                          **eval_kw)  # fmt: skip
                ev = evals[str(a.rl_steps)]
                results[key] = {"strategy": variant, "seed": seed, "eval": ev, "evals": evals, "history": history,
                                "rl_wall_s": rl_s}  # fmt: skip
                printer(f"        held-out pass@1 {100 * ev['pass@1']:.1f} %, mean reward "
                        f"{statistics.fmean(h['reward'] for h in history):+.3f}, {rl_s:.0f} s")  # fmt: skip
                done.update(runs=results, config=vars(a))
                out_json.write_text(json.dumps(done, indent=1), encoding="utf-8")
    done["config"] = vars(a)
    summary = summarize(done, a.strategies)
    done["summary"] = summary
    done["matched"] = matched(done, a.strategies)
    if "chain" in a.families:
        done["chain_errors"] = chain_error_tables(done, work)
    out_json.write_text(json.dumps(done, indent=1), encoding="utf-8")
    (work / "study.md").write_text(render(done), encoding="utf-8")
    plot(done, work / "study.png")
    plot_compute(done, work / "study_compute.png")
    printer(render(done))
    return done


def matched(done: dict, strategies) -> dict:
    """`compute.matched_budget` for every budget, over the runs of `strategies` that have checkpoint evaluations."""
    from appo_trl.synthetic.compute import BUDGETS, matched_budget

    runs = [r for r in done["runs"].values() if r["strategy"] in strategies and r.get("evals")]
    if not runs:
        return {}
    out = {key: matched_budget(runs, key, done["sft"]["pass@1"]) for key in BUDGETS}
    if "chain" in done["sft"].get("by_family", {}):  # the chains' question: their pass@1 at matched sampled tokens
        out[CHAIN_MATCHED] = matched_budget(runs, "sampled_tokens", done["sft"]["by_family"]["chain"], family="chain")
    return out


def chain_error_tables(done: dict, work: Path) -> dict:
    """Where the chain questions fail (`appo_trl.synthetic.chain_errors`): the SFT start, and each variant after
    K steps over its finished seeds."""
    from appo_trl.synthetic.chain_errors import error_table

    tables = {"SFT": error_table(work)}
    for s in done["summary"]:
        seeds = sorted(r["seed"] for r in done["runs"].values() if r["strategy"] == s)
        tables[s] = error_table(work, s, step=done["config"]["rl_steps"], seeds=seeds)
    return tables


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
            "by_family": {
                f: statistics.fmean(r["eval"]["by_family"][f] for r in runs)
                for f in runs[0]["eval"].get("by_family", {})
            },  # fmt: skip
            "by_family_sd": {
                f: _mean_sd([r["eval"]["by_family"][f] for r in runs])[1] for f in runs[0]["eval"].get("by_family", {})
            },  # fmt: skip
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
    lines += _render_matched(done) + _render_families(done)
    if done.get("chain_errors"):
        from appo_trl.synthetic.chain_errors import render as chain_table

        lines += [
            "",
            "Where the chain questions fail after K steps: each chain sample in one category, seeds pooled "
            "(`appo_trl.synthetic.chain_errors` defines them).",
            "",
            chain_table(done["chain_errors"]).rstrip(),
        ]
    return "\n".join(lines) + "\n"


def _render_matched(done: dict) -> list[str]:
    from appo_trl.synthetic.compute import BUDGETS

    m = done.get("matched") or {}
    if not m:
        return []
    names = list(done["summary"])
    lines = ["", "Held-out pass@1 at matched compute: each variant at the budget where the cheapest finished K steps "
             "(the smallest final budget of any run), interpolated linearly between its evaluated checkpoints "
             "(step 0 = the SFT model), mean ± sd over seeds.", "",
             "| budget | matched at | cheapest | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]  # fmt: skip
    chain = {CHAIN_MATCHED: "chain family only, policy-sampled tokens"} if CHAIN_MATCHED in m else {}
    for key, label in {**BUDGETS, **chain}.items():
        row = m[key]
        cells = []
        for s in names:
            v = row["strategies"].get(s)
            cells.append("-" if v is None or v["mean"] is None else f"{100 * v['mean']:.1f} ± {100 * v['sd']:.1f} %")
        lines.append(f"| {label} | {row['budget']:.4g} | {row['cheapest']} | " + " | ".join(cells) + " |")
    return lines


def _render_families(done: dict) -> list[str]:
    names = [s for s, v in done["summary"].items() if v.get("by_family")]
    if not names:
        return []
    families = list(done["summary"][names[0]]["by_family"])
    sft = done["sft"].get("by_family", {})
    lines = ["", "Held-out pass@1 per question family after K steps (mean ± sd over seeds).", "",
             "| family | SFT | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]  # fmt: skip
    for f in families:
        cells = []
        for s in names:
            v = done["summary"][s]
            sd = v.get("by_family_sd", {}).get(f, float("nan"))
            cells.append(f"{100 * v['by_family'].get(f, float('nan')):.1f} ± {100 * sd:.1f} %")
        lines.append(f"| {f} | {100 * sft.get(f, float('nan')):.1f} % | " + " | ".join(cells) + " |")
    return lines


def plot_compute(done: dict, path) -> None:
    """Held-out pass@1 against each budget: one line per run (colour per variant), from the SFT start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from appo_trl.synthetic.compute import BUDGETS, curve

    fig, axes = plt.subplots(1, len(BUDGETS), figsize=(4 * len(BUDGETS), 3.6))
    for i, s in enumerate(done["summary"]):
        runs = [r for r in done["runs"].values() if r["strategy"] == s and r.get("evals")]
        for j, r in enumerate(runs):
            for ax, key in zip(axes, BUDGETS):
                xs, ys = zip(*curve(r, key, done["sft"]["pass@1"]))
                ax.plot(xs, [100 * y for y in ys], color=f"C{i}", marker="o", ms=3, alpha=0.8,
                        label=s if j == 0 else None)  # fmt: skip
    for ax, label in zip(axes, BUDGETS.values()):
        ax.set(xlabel=f"cumulative {label}", ylabel="held-out pass@1 (%)", title=label)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
