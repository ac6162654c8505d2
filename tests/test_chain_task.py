"""The `chain` family of the synthetic task: 3-5 dependent calls, exact tool results, wrong chains, no leakage."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re

import pytest

from appo_trl.synthetic.task import RESULT, build_task

ALL = ("python", "search", "both", "chain")
BOXED = re.compile(r"\\boxed\{([^}]*)\}")
CALL = re.compile(r"<(search|python)>(.*?)</\1>" + re.escape(RESULT.format("\x00")).replace("\x00", "(.*?)"), re.S)


@pytest.fixture(scope="module")
def task():
    return build_task(3, num_sft=600, num_rl=120, num_heldout=80, families=ALL)


def _docs(task) -> dict[str, str]:
    """query -> document text, as the search tool finds them (`<attr> of <name>`)."""
    out = {}
    for d in task.corpus:
        m = re.fullmatch(r"(\w+): The (\w+) of \1 is \w+\.", d["contents"])
        out[f"{m[2]} of {m[1]}"] = d["contents"]
    return out


def _solve(question: str, docs: dict[str, str]) -> str:
    """Follow the chain through the encyclopedia, independently of the generator."""

    def look(attr, name):
        return docs[f"{attr} of {name}"].rsplit(" ", 1)[1].rstrip(".")

    if m := re.fullmatch(r"What is the population of the neighbour of (\w+) times (\d)\?", question):
        return str(int(look("population", look("neighbour", m[1]))) * int(m[2]))
    if m := re.fullmatch(r"What is the population of (\w+) plus the population of the neighbour of \1\?", question):
        return str(int(look("population", m[1])) + int(look("population", look("neighbour", m[1]))))
    m = re.fullmatch(r"What is the population of the neighbour of the neighbour of (\w+) minus the population "
                     r"of \1\?", question)  # fmt: skip
    assert m, question
    return str(int(look("population", look("neighbour", look("neighbour", m[1])))) - int(look("population", m[1])))


def test_the_demo_task_is_unchanged_without_the_chain_family():
    """sha256 of the default task (seed 0, the demo's 1,800 SFT traces), taken when run G's task (3- and 4-digit
    python answers, the both traces' multiplier marker; docs/benchmarks.md "Demo") replaced run E's; before, when
    run D's traces replaced run C's, and before that before the chain family existed."""
    t = build_task(0, num_sft=1800)
    blob = json.dumps([[dataclasses.asdict(q) for q in s] for s in (t.sft, t.rl, t.heldout)] + [t.corpus],
                      sort_keys=True)  # fmt: skip
    assert hashlib.sha256(blob.encode()).hexdigest() == (
        "22db3b4fb3f71b3c717689355c2ddf2f23342f36ca900f43d0b14ea501c19ae8"
    )
    assert all(e.neighbour is None for e in t.entities)


def test_every_split_reports_the_chain_family_in_turn(task):
    for split in (task.sft, task.rl, task.heldout):
        counts = {f: sum(q.family == f for q in split) for f in ALL}
        assert max(counts.values()) - min(counts.values()) <= 1, counts


def test_chain_answers_follow_the_encyclopedia(task):
    docs = _docs(task)
    chain = [q for split in (task.sft, task.rl, task.heldout) for q in split if q.family == "chain"]
    assert len(chain) >= 100
    for q in chain:
        assert _solve(q.question, docs) == q.answer, q.question


def test_chain_traces_make_3_to_5_calls_with_the_exact_tool_results(task):
    docs = _docs(task)
    seen_calls = set()
    for q in task.sft:
        if q.family != "chain" or "<search>" not in q.trace:  # a weak teacher's tool-less guess
            continue
        calls = CALL.findall(q.trace)
        for tag, query, result in calls:
            if tag == "search":
                assert result == f"Page 1: {docs[query]}", (query, result)
            else:  # python: the printed value of the expression
                assert result == str(eval(query.removeprefix("print(").removesuffix(")")))  # noqa: S307
        assert calls[0][0] == "search" and calls[0][1].startswith("neighbour of ")  # every chain starts right
        assert calls[-1][0] == "python"
        if BOXED.search(q.trace)[1] == q.answer:
            seen_calls.add(len(calls))
    assert seen_calls == {3, 4, 5}


def test_a_share_of_sft_chain_traces_lose_track_and_rl_heldout_do_not(task):
    def wrong_share(split):
        traces = [q for q in split if q.family == "chain" and "<search>" in q.trace]
        return sum(BOXED.search(q.trace)[1] != q.answer for q in traces) / len(traces)

    assert 0.15 < wrong_share(task.sft) < 0.45  # CHAIN_WRONG_SHARE = 0.3 of ~150 traces
    assert wrong_share(task.rl) == wrong_share(task.heldout) == 0.0  # their traces are never trained on anyway


def test_no_leakage_between_splits(task):
    sizes = [len(task.sft), len(task.rl), len(task.heldout)]
    assert sizes == [600, 120, 80]
    names = [{e for q in split if q.family == "chain" for e in re.findall(r"of ([A-Z]\w+)", q.question)}
             for split in (task.sft, task.rl, task.heldout)]  # fmt: skip
    by_name = {e.name: e for e in task.entities}
    for i, split_names in enumerate(names):
        for n in split_names:  # a split's chains never reach an entity of another split
            reach = {n, by_name[n].neighbour, by_name[by_name[n].neighbour].neighbour}
            for j, other in enumerate(names):
                if j != i:
                    assert not reach & other
    texts = [q.question for split in (task.sft, task.rl, task.heldout) for q in split]
    assert len(texts) == len(set(texts))


def test_unknown_family_is_one_clear_error():
    with pytest.raises(ValueError, match=r"unknown question families \['chains'\]"):
        build_task(0, families=("python", "chains"))


def test_the_search_tool_finds_each_facts_own_page_first(task, tmp_path):
    """Every `<attr> of <name>` query of the chain task gets its own page as the strict top-1 of the real BM25
    index. Before each page named its entity twice, `neighbour of X` tied X's page with the page of the entity
    whose neighbour is X, and the tie showed the wrong page for about half of the neighbour hops."""
    from appo_trl.tools.search_server import BM25Index

    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in task.corpus))
    index = BM25Index(str(path))
    want = {d["contents"]: d["id"] for d in task.corpus}
    queries = [f"{attr} of {e.name}" for e in task.entities for attr in ("capital", "population", "neighbour")]
    wrong = []
    for query, hits in zip(queries, index.retrieve(queries, 2)):
        (top, score), (_, second) = hits[0], hits[1]
        attr, _, name = query.partition(" of ")
        if want[top["contents"]] != f"{name}-{attr}" or not score > second:
            wrong.append((query, top["contents"]))
    assert not wrong, f"{len(wrong)} of {len(queries)} queries: {wrong[:3]}"
