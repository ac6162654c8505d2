"""Where the python and both questions fail: each python-family (or both-family) sample in exactly one category.

A python question (`appo_trl.synthetic.task.python_question`) is "What is 137 * 4 + 5?"; its trace copies the
expression into `print(...)`, reads the printed value and boxes it. The categories, checked in this order:

1. `correct`: the boxed answer scores (exact match, as the held-out evaluation scores it).
2. `guessed without a tool`: no `<python>` call.
3. `expression mis-copied`: the first python call does not print the question's expression (spaces ignored).
4. `result mis-copied`: the question's expression was printed, and the box holds something else than its value.
5. `other`: anything else (a right first call, then more calls, or an answer block that cannot be read).

A both question (`task.both_question`) is "What is the population of Yoljor times 7?"; its trace searches `Yoljor
population`, then prints `452 * 7` and boxes the value. Its categories (`--family both`), in this order: `correct`,
`guessed without a tool` (neither a search nor a python call), `entity mis-copied` (the first query is not the
question's), `population mis-copied` / `multiplier mis-copied` (the first `print(P * k)` has another P, another k),
`result mis-copied` (the right call, one call, another number boxed), `other`.

`bad format` is counted beside the categories: samples the training reward (`arpo_deep_research`) scores -1.
`python -m appo_trl.synthetic.python_errors DIR...` prints the table for each held-out evaluation dir
(`<demo workdir>/eval/step<N>`: `samples.jsonl` beside the demo's `data/heldout.jsonl`) or training dump
(`<output_dir>/rollouts`: `step_*.jsonl`, every row of every group).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

CATEGORIES = ("correct", "guessed without a tool", "expression mis-copied", "result mis-copied", "other")
BOTH_CATEGORIES = ("correct", "guessed without a tool", "entity mis-copied", "population mis-copied",
                   "multiplier mis-copied", "result mis-copied", "other")  # fmt: skip
_QUESTION = re.compile(r"What is (.+)\?")
_BOTH = re.compile(r"What is the population of (\w+) times (\d+)\?")
_PRINT = re.compile(r"<python>\s*print\((.*?)\)\s*</python>", re.S)
_PRODUCT = re.compile(r"<python>\s*print\(\s*(-?\d+)\s*\*\s*(-?\d+)\s*\)\s*</python>")
_SEARCH = re.compile(r"<search>(.*?)</search>", re.S)


def _squash(s: str) -> str:
    return "".join(s.split())


def classify(question: str, answer: str, completion: str) -> str:
    """The category of one python-family sample (module head)."""
    from appo_trl.evaluation.metrics import extract_prediction
    from appo_trl.rewards.qa import exact_match

    if exact_match(extract_prediction(completion), answer):
        return "correct"
    if "<python>" not in completion:
        return "guessed without a tool"
    m, q = _PRINT.search(completion), _QUESTION.fullmatch(question.strip())
    if m is None or q is None or _squash(m.group(1)) != _squash(q.group(1)):
        return "expression mis-copied"
    if completion.count("<python>") == 1 and extract_prediction(completion):
        return "result mis-copied"
    return "other"


def classify_both(question: str, answer: str, completion: str) -> str:
    """The category of one both-family sample (module head)."""
    from appo_trl.evaluation.metrics import extract_prediction
    from appo_trl.rewards.qa import exact_match

    if exact_match(extract_prediction(completion), answer):
        return "correct"
    if "<python>" not in completion and "<search>" not in completion:
        return "guessed without a tool"
    name, k = _BOTH.fullmatch(question.strip()).groups()
    query = _SEARCH.search(completion)
    if query is None or query.group(1).strip() != f"{name} population":
        return "entity mis-copied"
    call = _PRODUCT.search(completion)
    if call is None:
        return "other"
    if int(call.group(1)) != int(answer) // int(k):
        return "population mis-copied"
    if call.group(2) != k:
        return "multiplier mis-copied"
    if completion.count("<python>") == 1 and extract_prediction(completion):
        return "result mis-copied"
    return "other"


def _family(question: str) -> str | None:
    """`python`, `both` or None (a search question) for a demo question's text."""
    if _BOTH.fullmatch(question.strip()):
        return "both"
    return "python" if _QUESTION.fullmatch(question.strip()) and " of " not in question else None


def table(samples: list[tuple[str, str, str]], family: str = "python") -> dict[str, float]:
    """Share of (question, answer, completion) samples per category, plus `bad format` and `samples`."""
    from appo_trl.rewards.deep_research import compute_score

    categories, rule = (BOTH_CATEGORIES, classify_both) if family == "both" else (CATEGORIES, classify)
    counts = Counter(rule(*s) for s in samples)
    n = len(samples)
    out = {c: counts[c] / n if n else 0.0 for c in categories}
    out["bad format"] = sum(compute_score(c, a) == -1.0 for _, a, c in samples) / n if n else 0.0
    out["samples"] = n
    return out


def eval_samples(eval_dir: str | Path, family: str = "python") -> list[tuple[str, str, str]]:
    """The `family` samples of a demo evaluation dir (`<workdir>/eval/step<N>`)."""
    eval_dir = Path(eval_dir)
    heldout = eval_dir.parents[1] / "data" / "heldout.jsonl"
    rows = [json.loads(x) for x in heldout.read_text().splitlines() if x.strip()]
    out = []
    for line in (eval_dir / "samples.jsonl").read_text().splitlines():
        rec = json.loads(line)
        row = rows[rec["index"]]
        if row["family"] == family:
            out.append((row["question"], row["answer"][0], rec["completion"]))
    return out


def dump_samples(rollouts: str | Path, steps: range | None = None,
                 family: str = "python") -> list[tuple[str, str, str]]:  # fmt: skip
    """The `family` rows of a training dump (`<output_dir>/rollouts/step_*.jsonl`), optionally some steps."""
    out = []
    for f in sorted(Path(rollouts).glob("step_*.jsonl")):
        if steps is not None and int(f.stem.split("_")[1]) not in steps:
            continue
        for line in f.read_text().splitlines():
            g = json.loads(line)
            if _family(g["prompt"]) == family:
                out += [
                    (g["prompt"], str(g["answer"]), r["completion"]) for r in g["rows"] if r.get("role") != "chain"
                ]
    return out


def render(name: str, t: dict[str, float]) -> str:
    cells = "  ".join(f"{c} {100 * v:.0f} %" for c, v in t.items() if c != "samples")
    return f"{name} ({t['samples']} samples): {cells}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m appo_trl.synthetic.python_errors", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("dirs", nargs="+", help="demo eval dirs (eval/step<N>) or training dumps (rollouts/)")
    p.add_argument("--steps", type=int, nargs=2, metavar=("FIRST", "LAST"), help="dump steps FIRST..LAST only")
    p.add_argument("--family", choices=("python", "both"), default="python", help="the question family")
    a = p.parse_args(argv)
    for d in a.dirs:
        if (Path(d) / "samples.jsonl").is_file():
            samples = eval_samples(d, a.family)
        elif any(Path(d).glob("step_*.jsonl")):
            samples = dump_samples(d, range(a.steps[0], a.steps[1] + 1) if a.steps else None, a.family)
        else:
            p.exit(2, f"python_errors: error: {d} holds neither samples.jsonl nor rollouts/step_*.jsonl\n")
        print(render(d, table(samples, a.family)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
