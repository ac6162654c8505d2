"""Reports of an evaluation run: `report.json` (every number + the config), `report.md` (benchmarks x
metrics), `report.png` (pass@k curves and the tool-call distribution), `predictions.jsonl` (per-sample
predictions and scores), a printed summary, and the side-by-side comparison of two reports.

Aggregation, per benchmark: the mean of every per-sample score over all samples (= avg@n), pass@k (the
unbiased estimator over the `pass_metric`, a 0/1 score) and avg@k (mean headline score over the first k
samples) for each k <= n, and tool statistics. The overall row is the unweighted mean over benchmarks.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from appo_trl.evaluation.passk import avg_at_k, default_ks, mean_pass_at_k

REPORT_VERSION = 1


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def summarize_benchmark(bench, questions, records_by_q: dict[int, list[dict]], ks, judged: bool) -> dict[str, Any]:
    """Numbers of one benchmark from its scored records grouped by question (samples in order)."""
    from appo_trl.evaluation.metrics import tool_stats

    metric, pass_metric = bench.resolved_metrics(judged)
    groups = [sorted(records_by_q[q], key=lambda r: r["sample"]) for q in questions if records_by_q.get(q)]
    flat = [r for g in groups for r in g]
    n = min((len(g) for g in groups), default=0)
    ks = [k for k in (ks or default_ks(n)) if 1 <= k <= n]
    names = sorted({m for r in flat for m in r["scores"]})
    out: dict[str, Any] = {
        "task": bench.task,
        "prompt": bench.prompt,
        "tools": list(bench.tools),
        "questions": len(groups),
        "samples_per_question": n,
        "metric": metric,
        "pass_metric": pass_metric,
        "score": _mean(r["scores"][metric] for r in flat),
        "metrics": {m: _mean(r["scores"][m] for r in flat) for m in names},
        "pass@k": {
            str(k): mean_pass_at_k([(len(g), sum(r["scores"][pass_metric] >= 1.0 for r in g)) for g in groups], k)
            for k in ks
        },  # fmt: skip
        "avg@k": {str(k): avg_at_k([[r["scores"][metric] for r in g] for g in groups], k) for k in ks},
        "tools_stats": tool_stats(flat, bench.tools),
    }
    if judged:
        out["judge"] = {
            "calls": sum(1 for r in flat if r["judge"]["source"] == "judge"),
            "errors": sum(1 for r in flat if r["judge"]["error"]),
            "by_rule": sum(1 for r in flat if r["judge"]["source"] == "rule"),
        }
    return out


def build_report(config, benches, examples, records: dict[tuple, dict], judged: bool) -> dict[str, Any]:
    by_bench: dict[str, dict[int, list[dict]]] = {}
    for (name, index, _), rec in records.items():
        by_bench.setdefault(name, {}).setdefault(index, []).append(rec)
    results = {
        b.name: summarize_benchmark(
            b, [ex.index for ex in examples[b.name]], by_bench.get(b.name, {}), config.ks, judged
        )
        for b in benches
    }
    judge = config.judge.public() if judged and config.judge.enabled else None
    return {
        "version": REPORT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": config.model,
        "judge_model": judge["model"] if judge else None,
        "config": config.to_dict(),
        "overall": {"score": _mean(r["score"] for r in results.values()), "benchmarks": len(results)},
        "benchmarks": results,
    }


def render_markdown(report: dict[str, Any]) -> str:
    """A Markdown table: one row per benchmark, headline score, rule metrics, pass@k, tool use."""
    ks = sorted({int(k) for r in report["benchmarks"].values() for k in r["pass@k"]})
    head = ["benchmark", "questions x n", "metric", "score", "EM", "F1", "cover-EM", "math", "judge"]
    head += [f"pass@{k}" for k in ks] + ["calls/sample", "tool use", "limit hits", "out chars"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def pct(x):
        return "–" if x is None else f"{100 * x:.1f}"

    for name, r in report["benchmarks"].items():
        m, t = r["metrics"], r["tools_stats"]
        row = [name, f"{r['questions']} x {r['samples_per_question']}", r["metric"], pct(r["score"])]
        row += [pct(m.get(x)) for x in ("em", "f1", "cover_em", "math_equal", "llm_judge")]
        row += [pct(r["pass@k"].get(str(k))) for k in ks]
        row += [f"{t.get('calls_per_sample', 0):.2f}", pct(t.get("share_with_tools", 0)),
                str(t.get("limit_hits", 0)), f"{t.get('output_length_chars', 0):.0f}"]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    cfg = report["config"]
    lines += [
        "",
        f"Overall (mean over {report['overall']['benchmarks']} benchmarks): **{pct(report['overall']['score'])}**. "
        f"Model `{report['model']}`, n={cfg['num_samples']} samples/question, T={cfg['temperature']}, "
        f"top_p={cfg['top_p']}, seed={cfg['seed']}, search backend `{cfg['search_backend']}`"
        + (f", judge `{report['judge_model']}`." if report.get("judge_model") else ", no LLM judge."),
        "Scores in %; pass@k is the unbiased estimator 1 - C(n-c,k)/C(n,k) over each benchmark's pass metric.",
    ]
    return "\n".join(lines) + "\n"


def plot_report(report: dict[str, Any], path: str | Path) -> None:
    """pass@k curves per benchmark (left) and the distribution of tool calls per sample (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in report["benchmarks"].items():
        ks = sorted(int(k) for k in r["pass@k"])
        if ks:
            ax1.plot(ks, [100 * r["pass@k"][str(k)] for k in ks], marker="o", label=name)
        hist = r["tools_stats"].get("calls_histogram", {})
        total = sum(hist.values()) or 1
        xs = sorted(int(c) for c in hist)
        ax2.plot(xs, [100 * hist[str(c)] / total for c in xs], marker="s", label=name)
    all_ks = sorted({int(k) for r in report["benchmarks"].values() for k in r["pass@k"]})
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(all_ks or [1], [str(k) for k in all_ks or [1]])
    ax1.minorticks_off()
    ax2.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax2.set_xlim(left=-0.5)
    for ax in (ax1, ax2):
        ax.set_ylim(0, 102)
    ax1.set(xlabel="k", ylabel="pass@k (%)", title="pass@k per benchmark")
    ax2.set(xlabel="tool calls per sample", ylabel="samples (%)", title="tool-call distribution")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['model'] or 'model'}: n={report['config']['num_samples']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(report: dict[str, Any], out_dir: str | Path, records: dict[tuple, dict] | None = None) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False), encoding="utf-8")
    (out_dir / "report.md").write_text(render_markdown(report), encoding="utf-8")
    plot_report(report, out_dir / "report.png")
    if records is not None:
        keep = ("benchmark", "index", "sample", "prediction", "golds", "scores", "judge", "finish_reason")
        with open(out_dir / "predictions.jsonl", "w", encoding="utf-8") as f:
            for key in sorted(records):
                f.write(json.dumps({k: records[key][k] for k in keep if k in records[key]}, ensure_ascii=False) + "\n")


def print_summary(report: dict[str, Any], console=None) -> None:
    """A rich table of the headline numbers."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"appo eval: {report['model'] or 'model'}")
    ks = sorted({int(k) for r in report["benchmarks"].values() for k in r["pass@k"]})
    for col in ["benchmark", "metric", "score", *[f"pass@{k}" for k in ks], "calls/sample", "tool use %"]:
        table.add_column(col, justify="left" if col in ("benchmark", "metric") else "right")
    for name, r in report["benchmarks"].items():
        t = r["tools_stats"]
        table.add_row(name, r["metric"], f"{100 * r['score']:.1f}", *[f"{100 * r['pass@k'][str(k)]:.1f}" if str(k) in r["pass@k"] else "–" for k in ks],
                      f"{t.get('calls_per_sample', 0):.2f}", f"{100 * t.get('share_with_tools', 0):.1f}")  # fmt: skip
    table.add_row("overall", "", f"{100 * report['overall']['score']:.1f}")
    console.print(table)


def compare_reports(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-benchmark rows comparing two reports (benchmarks present in either; None where one lacks it)."""
    rows = []
    names = list(a["benchmarks"]) + [n for n in b["benchmarks"] if n not in a["benchmarks"]]
    for name in names:
        ra, rb = a["benchmarks"].get(name), b["benchmarks"].get(name)
        row: dict[str, Any] = {"benchmark": name, "metric": (ra or rb)["metric"]}
        for label, get in (("score", lambda r: r["score"]), ("pass@1", lambda r: r["pass@k"].get("1")),
                           ("calls/sample", lambda r: r["tools_stats"].get("calls_per_sample"))):  # fmt: skip
            va, vb = (get(ra) if ra else None), (get(rb) if rb else None)
            row[label] = (va, vb, None if va is None or vb is None else vb - va)
        if ra and rb and ra["metric"] != rb["metric"]:
            row["metric"] = f"{ra['metric']} / {rb['metric']}"
        rows.append(row)
    return rows


def print_comparison(a: dict[str, Any], b: dict[str, Any], names=("A", "B"), console=None) -> list[dict[str, Any]]:
    from rich.console import Console
    from rich.table import Table

    rows = compare_reports(a, b)
    console = console or Console()
    table = Table(title=f"{names[0]} ({a.get('model')}) vs {names[1]} ({b.get('model')})")
    table.add_column("benchmark")
    table.add_column("metric")
    for label in ("score", "pass@1", "calls/sample"):
        for suffix in (names[0], names[1], "Δ"):
            table.add_column(f"{label} {suffix}", justify="right")

    def fmt(x, label, signed=False):
        if x is None:
            return "–"
        sign = "+" if signed else ""
        return f"{x:{sign}.2f}" if label == "calls/sample" else f"{100 * x:{sign}.1f}"

    for row in rows:
        cells = [row["benchmark"], row["metric"]]
        for label in ("score", "pass@1", "calls/sample"):
            va, vb, d = row[label]
            cells += [fmt(va, label), fmt(vb, label), fmt(d, label, signed=True)]
        table.add_row(*cells)
    console.print(table)
    return rows
