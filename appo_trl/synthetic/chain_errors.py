"""Where the chain questions fail: each held-out chain sample in exactly one error category.

A chain question (`appo_trl.synthetic.chains`) starts at an entity and follows its neighbour links; its correct
solution makes a fixed set of searches, each `<attr> of <name>` for an entity on the chain (the start entity and
its one or two neighbour hops). A search names an entity by the capitalised words of its query and asks for an
attribute by the words `neighbour`, `population` or `capital`. It is *on the chain* when it is one of the correct
solution's searches (one name, one attribute, either word order) and was not made before; every other search is
*off the chain*. The categories, checked in this order (the first that holds wins):

1. `correct`: the answer scores (exact match).
2. `guessed without a tool`: the completion makes no search at all (a python call alone computes on guessed
   numbers).
3. `mis-copied name`: the first search off the chain names no entity of the chain (a name copied wrongly from
   a tool result or the question, or no name at all).
4. `wrong hop`: the first search off the chain names only entities of the chain, but is no step still to take:
   a skipped hop (`population of Velmora` for its neighbour's), an extra hop, a repeated search, or a wrong or
   missing attribute.
5. `stopped early`: every search is on the chain but some of the correct solution's searches are missing.
6. `right searches, wrong answer`: exactly the correct solution's searches, and still a wrong answer.

Searches are read from the completion text (`<search>...</search>`), as the rollout engine executes them.
`error_table` reads the held-out evaluations of an `appo study` work dir; `python -m
appo_trl.synthetic.chain_errors WORKDIR` prints the table of docs/study.md, section 3.2.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Mapping
from pathlib import Path

# display order (docs/study.md's columns); `classify` checks them in the order of the module head
CATEGORIES = ("correct", "mis-copied name", "guessed without a tool", "stopped early", "wrong hop",
              "right searches, wrong answer")  # fmt: skip
ATTRS = ("neighbour", "population", "capital")
_WORDS = {*ATTRS, "the", "of", "what", "is"}  # capitalised, these are not names ("Population of Velmora")
_SEARCH = re.compile(r"<search>(.*?)</search>", re.S)
_NAME = re.compile(r"\b[A-Z][a-z]+\b")
# the three templates of `chains.chain_question`: (pattern, searches of the correct solution)
_TEMPLATES = (
    (re.compile(r"What is the population of the neighbour of the neighbour of (\w+) minus the population of \1\?"),
     lambda e, h1, h2: [("neighbour", e), ("neighbour", h1), ("population", h2), ("population", e)]),
    (re.compile(r"What is the population of (\w+) plus the population of the neighbour of \1\?"),
     lambda e, h1, h2: [("neighbour", e), ("population", h1), ("population", e)]),
    (re.compile(r"What is the population of the neighbour of (\w+) times \d+\?"),
     lambda e, h1, h2: [("neighbour", e), ("population", h1)]),
)  # fmt: skip


def chain_searches(question: str, neighbours: Mapping[str, str]) -> list[tuple[str, str]]:
    """The (attribute, name) searches of the correct solution of a chain `question`, in the trace's order.

    Args:
        question: the question text (`Question.question`, the held-out row's `question`).
        neighbours: each entity's neighbour by name (`neighbours_from_corpus`, or `{e.name: e.neighbour}`).
    """
    for pattern, searches in _TEMPLATES:
        m = pattern.fullmatch(question.strip())
        if m:
            start = m.group(1)
            if start not in neighbours:
                raise ValueError(f"{start!r} of the chain question has no neighbour link: {question!r}")
            hop1 = neighbours[start]
            return searches(start, hop1, neighbours.get(hop1))
    raise ValueError(f"not a chain question: {question!r}")


def parse_search(query: str) -> tuple[set[str], set[str]]:
    """(names, attributes) a search query mentions: its capitalised words and its attribute words."""
    words = set(re.findall(r"[a-z]+", query.lower()))
    return {w for w in _NAME.findall(query) if w.lower() not in _WORDS}, {a for a in ATTRS if a in words}


def classify(question: str, completion: str, correct: bool, neighbours: Mapping[str, str]) -> str:
    """The error category (one of `CATEGORIES`) of one sample of a chain question; the module head defines them.

    Args:
        question: the chain question text.
        completion: the sampled completion, tool results included (`samples.jsonl`'s `completion`).
        correct: whether the answer scored (`predictions.jsonl`'s `em`).
        neighbours: each entity's neighbour by name.
    """
    needed = chain_searches(question, neighbours)
    if correct:
        return "correct"
    queries = _SEARCH.findall(completion)
    if not queries:
        return "guessed without a tool"
    on_chain = {name for _, name in needed}
    done: set[tuple[str, str]] = set()
    for query in queries:
        names, attrs = parse_search(query)
        step = (next(iter(attrs)), next(iter(names))) if len(names) == 1 and len(attrs) == 1 else None
        if step in needed and step not in done:
            done.add(step)
            continue
        return "wrong hop" if names and names <= on_chain else "mis-copied name"
    return "stopped early" if len(done) < len(needed) else "right searches, wrong answer"


def neighbours_from_corpus(path: str | Path) -> dict[str, str]:
    """Each entity's neighbour by name, from a task's `corpus.jsonl` (its `<name>-neighbour` documents)."""
    docs = [d["contents"] for d in _jsonl(Path(path)) if d["id"].endswith("-neighbour")]
    return {m[1]: m[2] for m in (re.search(r"The neighbour of (\w+) is (\w+)\.", c) for c in docs) if m}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def eval_dirs(workdir: str | Path, variant: str | None = None, step: int | None = None, seeds=None) -> list[Path]:
    """The evaluation dirs of `variant` (None: the SFT model): `eval/sft`, or for each seed of an RL variant
    `eval/<variant>/seed<S>/step<K>` at `step` (default: the seed's last finished evaluation). With `seeds`, each
    of them must have one; without, the seeds that have one."""
    root = Path(workdir) / "eval"
    if variant is None:
        return [root / "sft"] if (root / "sft" / "predictions.jsonl").is_file() else []
    out = []
    found = sorted((root / variant).glob("seed*"), key=lambda p: int(p.name[4:]))
    for seed in found if seeds is None else [root / variant / f"seed{s}" for s in seeds]:
        steps = {int(d.name[4:]): d for d in seed.glob("step*") if (d / "predictions.jsonl").is_file()}
        if steps and (step is None or step in steps):
            out.append(steps[step if step is not None else max(steps)])
        elif seeds is not None:
            raise FileNotFoundError(f"no finished evaluation{'' if step is None else f' at step {step}'} in {seed}")
    return out


def error_table(workdir: str | Path, variant: str | None = None, step: int | None = None, seeds=None) -> dict:
    """Share of each category over every chain sample of `variant`'s evaluations (`eval_dirs`), seeds pooled.

    Returns:
        `{"shares": {category: share}, "counts": {category: n}, "samples": n, "dirs": [the dirs read, relative to
        eval/]}`; the shares sum to 1.
    """
    work = Path(workdir)
    rows = _jsonl(work / "data" / "heldout.jsonl")
    neighbours = neighbours_from_corpus(work / "data" / "corpus.jsonl")
    dirs = eval_dirs(work, variant, step, seeds)
    if not dirs:
        raise FileNotFoundError(f"no finished evaluation of {variant or 'sft'} under {work / 'eval'}")
    counts = dict.fromkeys(CATEGORIES, 0)
    for d in dirs:
        em = {(p["index"], p["sample"]): p["scores"]["em"] for p in _jsonl(d / "predictions.jsonl")}
        for s in _jsonl(d / "samples.jsonl"):
            row = rows[s["index"]]
            if row.get("family") != "chain":
                continue
            if (s["index"], s["sample"]) not in em:
                raise ValueError(f"{d}: sample {s['index']}/{s['sample']} has no prediction (evaluation unfinished?)")
            counts[classify(row["question"], s["completion"], em[s["index"], s["sample"]] > 0, neighbours)] += 1
    n = sum(counts.values())
    if n == 0:
        raise ValueError(f"{work / 'data' / 'heldout.jsonl'} has no chain question")
    return {"shares": {c: k / n for c, k in counts.items()}, "counts": counts, "samples": n,
            "dirs": [str(d.relative_to(work / "eval")) for d in dirs]}  # fmt: skip


def render(tables: Mapping[str, dict]) -> str:
    """A markdown table, one row per `{label: error_table(...)}`, with the samples and evaluations read."""
    head = ["", *CATEGORIES, "chain samples", "evaluations read"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for label, t in tables.items():
        shares = [f"{100 * t['shares'][c]:.0f} %" for c in CATEGORIES]
        lines.append("| " + " | ".join([label, *shares, str(t["samples"]), ", ".join(t["dirs"])]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m appo_trl.synthetic.chain_errors", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("workdir", help="an `appo study` work dir with the chain family")
    p.add_argument("--variants", nargs="+", default=None, help="RL variants (default: every one under eval/)")
    p.add_argument("--step", type=int, default=None, help="RL step to read (default: each seed's last)")
    a = p.parse_args(argv)
    eval_root = Path(a.workdir) / "eval"
    if a.variants is None:  # every variant with a finished evaluation, in the study's order (its study.json's)
        study = Path(a.workdir) / "study.json"
        listed = json.loads(study.read_text()).get("config", {}).get("strategies", []) if study.is_file() else []
        order = {v: i for i, v in enumerate(listed)}
        found = [d.name for d in eval_root.glob("*") if d.name != "sft" and eval_dirs(a.workdir, d.name, a.step)]
        a.variants = sorted(found, key=lambda v: (order.get(v, len(order)), v))
    try:
        tables = {"SFT": error_table(a.workdir)}
        tables.update({v: error_table(a.workdir, v, a.step) for v in a.variants})
    except (FileNotFoundError, ValueError) as e:
        p.exit(2, f"chain_errors: error: {e}\n")
    print(render(tables), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
