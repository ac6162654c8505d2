"""Three checks of a finished `appo demo` run, the ones docs/benchmarks.md ("Demo", run H) quotes.

`noise WORKDIR`: the held-out evaluation's own noise. The SFT checkpoint (or `--model`) is evaluated as the
demo evaluates it, under several sampling seeds (`--seeds 100-107`); prints pass@1 and pass@k per seed, their
mean and sd, and `1.96 * sqrt(2) * sd`, the bound on a difference of two evaluations that noise alone stays
inside 95 % of the time.

`multiplier WORKDIR [CHECKPOINT ...]`: does the model still copy a both question's multiplier k, per k, on the
RL prompts (the questions it trains on, never the held-out ones)? `appo_trl.synthetic.copying.multiplier_copy`
on each k's questions: the share whose greedy next token is k, where `<think>` states it and where the python
call writes it. Checkpoints default to the SFT start, every `rl/checkpoint-*` and the final `rl/`.

`heldout WORKDIR`: the same copy read from the demo's own held-out dumps (`WORKDIR/eval/step*/samples.jsonl`):
per evaluated step and k, how many of the both questions' python calls (`print(N * m)`) write m = k.

    python scripts/demo_checks.py noise outputs/demo
    python scripts/demo_checks.py multiplier outputs/demo
    python scripts/demo_checks.py heldout outputs/demo

`noise` and `multiplier` read the task's settings from `WORKDIR/report.json` (seed, sizes), so they see the run's
own questions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _report(work: Path) -> dict:
    path = work / "report.json"
    if not path.is_file():
        raise SystemExit(f"demo_checks: {path} not found (a finished `appo demo --workdir {work}` writes it)")
    return json.loads(path.read_text())


def _seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def noise(work: Path, model: str | None, seeds: list[int], samples: int) -> dict:
    from appo_trl.synthetic import pipeline as P

    model = model or str(work / "sft")
    rows = []
    with P.search_server(str(work / "data" / "corpus.jsonl"), str(work / "noise_search.log")) as srv:
        with tempfile.TemporaryDirectory(prefix="appo-demo-noise-") as tmp:
            for seed in seeds:
                r = P.evaluate_heldout(model, str(work / "data" / "benchmarks.yaml"), srv.url, f"{tmp}/s{seed}",
                                       num_samples=samples, seed=seed)  # fmt: skip
                rows.append({"seed": seed, "pass@1": 100 * r["pass@1"], "pass@k": 100 * r["pass@k"],
                             "by_family": {f: 100 * v for f, v in r["by_family"].items()}})  # fmt: skip
                fams = "  ".join(f"{f} {v:.1f}" for f, v in rows[-1]["by_family"].items())
                print(f"eval seed {seed}: pass@1 {rows[-1]['pass@1']:.1f} %  pass@{r['k']} {rows[-1]['pass@k']:.1f} %"
                      f"  ({fams})", flush=True)  # fmt: skip
    out = {"model": model, "seeds": seeds, "runs": rows}
    for key in ("pass@1", "pass@k"):
        values = [r[key] for r in rows]
        sd = statistics.stdev(values) if len(values) > 1 else float("nan")
        out[key] = {"mean": statistics.mean(values), "sd": sd, "min": min(values), "max": max(values),
                    "difference_bound": 1.96 * math.sqrt(2) * sd}  # fmt: skip
        print(f"{key}: mean {out[key]['mean']:.2f}  sd {sd:.2f}  range {min(values):.1f}-{max(values):.1f}  "
              f"1.96*sqrt(2)*sd = {out[key]['difference_bound']:.2f} points", flush=True)  # fmt: skip
    return out


def multiplier(work: Path, checkpoints: list[str]) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from appo_trl.synthetic.copying import multiplier_copy
    from appo_trl.synthetic.task import MULTIPLIER_MARKER, build_task

    transformers.utils.logging.disable_progress_bar()
    rep = _report(work)
    task = build_task(rep["seed"], num_sft=rep["num_sft"], num_heldout=rep["heldout_questions"],
                      guess_share=rep["guess_share"])  # fmt: skip
    written = [json.loads(line)["prompt"] for line in (work / "data" / "rl.jsonl").read_text().splitlines()]
    if written != [q.question for q in task.rl]:
        raise SystemExit(f"demo_checks: {work}/data/rl.jsonl is not the task of report.json's settings")
    by_k: dict[str, list] = {}
    for q in task.rl:
        if q.family == "both":
            by_k.setdefault(q.named.rsplit(MULTIPLIER_MARKER, 1)[1], []).append(q)
    if not checkpoints:
        ckpts = sorted((work / "rl").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        checkpoints = [str(work / "sft"), *map(str, ckpts), str(work / "rl")]
    out: dict = {"questions_per_k": {k: len(v) for k, v in sorted(by_k.items())}, "checkpoints": {}}
    print("share copying k (think / call) on the RL prompts; questions per k: "
          + ", ".join(f"{k}: {n}" for k, n in out["questions_per_k"].items()), flush=True)  # fmt: skip
    for ckpt in checkpoints:
        tok = AutoTokenizer.from_pretrained(ckpt)
        model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
        row = {k: multiplier_copy(model, tok, qs) for k, qs in sorted(by_k.items())}
        out["checkpoints"][ckpt] = row
        print(f"{os.path.relpath(ckpt, work):>20}: "
              + "  ".join(f"k={k} {r['think']:.2f}/{r['call']:.2f}" for k, r in row.items()), flush=True)  # fmt: skip
    return out


_CALL_K = re.compile(r"print\(\s*\d+\s*\*\s*(\d+)\s*\)")
_QUESTION_K = re.compile(r"times (\d+)\?$")


def heldout(work: Path) -> dict:
    questions = [json.loads(line) for line in (work / "data" / "heldout.jsonl").read_text().splitlines()]
    steps = sorted((work / "eval").glob("step*/samples.jsonl"), key=lambda p: int(p.parent.name[4:]))
    if not steps:
        raise SystemExit(f"demo_checks: no {work}/eval/step*/samples.jsonl (a finished `appo demo` writes them)")
    out: dict = {}
    for path in steps:
        counts: dict[str, list[int]] = {}  # k -> [calls writing k, calls]
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            q = questions[sample["index"]]
            if q["family"] != "both":
                continue
            k = _QUESTION_K.search(q["question"]).group(1)
            for call in sample["tool_calls"]:
                m = _CALL_K.search(call.get("query") or "") if call["tag"] == "python" else None
                if m:
                    c = counts.setdefault(k, [0, 0])
                    c[0] += m.group(1) == k
                    c[1] += 1
        out[path.parent.name] = {k: {"copied": c[0], "calls": c[1]} for k, c in sorted(counts.items())}
        print(f"{path.parent.name:>8}: " + "  ".join(f"k={k} {c[0]}/{c[1]}" for k, c in sorted(counts.items())),
              flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="check", required=True)
    n = sub.add_parser("noise", help="the held-out evaluation's noise under several sampling seeds")
    n.add_argument("workdir")
    n.add_argument("--model", help="the checkpoint to evaluate (default: WORKDIR/sft)")
    n.add_argument("--seeds", default="100-107", help="sampling seeds, LO-HI (default: %(default)s)")
    n.add_argument("--samples", type=int, default=4, help="samples per question, the k of pass@k")
    m = sub.add_parser("multiplier", help="the multiplier copy per k on the RL prompts, per checkpoint")
    m.add_argument("workdir")
    m.add_argument("checkpoints", nargs="*", help="default: WORKDIR/sft, WORKDIR/rl/checkpoint-*, WORKDIR/rl")
    h = sub.add_parser("heldout", help="the multiplier copy per k in the held-out dumps' python calls, per step")
    h.add_argument("workdir")
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(a.workdir)
    if a.check == "noise":
        seeds = _seeds(a.seeds)
        if len(seeds) < 2:
            p.error("--seeds needs at least two seeds for an sd")
        _report(work)
        out = noise(work, a.model, seeds, a.samples)
    elif a.check == "heldout":
        out = heldout(work)
    else:
        out = multiplier(work, a.checkpoints)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
