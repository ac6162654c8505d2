"""The synthetic demo task (appo_trl.synthetic): determinism, disjoint splits, correct traces, real tools agree."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from appo_trl.rewards.deep_research import compute_score
from appo_trl.synthetic import build_task, write_task
from appo_trl.synthetic.task import corpus


def test_same_seed_same_task_other_seed_other_task():
    a, b, c = build_task(3), build_task(3), build_task(4)
    assert [q.question for q in a.rl] == [q.question for q in b.rl]
    assert a.corpus == b.corpus
    assert [q.question for q in a.heldout] != [q.question for q in c.heldout]


def test_splits_share_no_question_and_no_searched_entity():
    t = build_task(0)
    splits = {"sft": t.sft, "rl": t.rl, "heldout": t.heldout}
    questions = {k: {q.question for q in v} for k, v in splits.items()}
    assert not questions["sft"] & questions["rl"] and not questions["sft"] & questions["heldout"]
    assert not questions["rl"] & questions["heldout"]
    names = {e.name for e in t.entities}

    def entities(qs):
        return {w.rstrip("?") for q in qs for w in q.question.split() if w.rstrip("?") in names}

    held = entities(t.heldout)
    assert held and not held & entities(t.sft) and not held & entities(t.rl)
    assert {q.family for q in t.heldout} == {"python", "search", "both"}


def test_traces_are_valid_and_score_full_marks():
    t = build_task(1, guess_share=0.0)
    for q in t.sft:
        bonus = 0.1 if q.family == "both" else 0.0  # ARPO's multi-tool bonus
        assert compute_score(q.trace, q.answer) == pytest.approx(1.0 + bonus), q.trace
        assert q.trace.count("<result>") == {"python": 1, "search": 1, "both": 2}[q.family]


def test_a_third_of_the_sft_traces_are_tool_less_guesses_and_nothing_else_changes():
    clean, noisy = build_task(1, num_sft=600, guess_share=0.0), build_task(1, num_sft=600)
    guesses = [q for q in noisy.sft if "<result>" not in q.trace]
    assert 0.28 < len(guesses) / len(noisy.sft) < 0.39  # GUESS_SHARE = 1/3, drawn per trace
    assert {q.family for q in guesses} == {"python", "search", "both"}
    for q in guesses:
        # a guess names what it is asked about as every trace does (`<think>Velmora capital: I know it.`)
        named = f"{q.named}: " if q.named else ""
        assert re.fullmatch(rf"<think>{named}I know it\.</think><answer>\\boxed\{{[^}}]+\}}</answer>", q.trace), (
            q.trace
        )
        assert bool(q.query) == (q.family != "python")
        assert compute_score(q.trace, q.answer) < 1.0  # well-formed, and wrong
        if q.family == "search" and not q.answer.isdigit():  # a guessed capital is another name, never the capital
            assert re.search(r"\\boxed\{(\w+)\}", q.trace).group(1) != q.answer
    # the guesses replace traces only: same questions in every split, and RL / held-out untouched
    assert [q.question for q in clean.sft] == [q.question for q in noisy.sft]
    assert [(q.question, q.trace) for q in clean.rl + clean.heldout] == [
        (q.question, q.trace) for q in noisy.rl + noisy.heldout
    ]
    with pytest.raises(ValueError, match="guess_share"):
        build_task(1, guess_share=1.0)


def test_answers_follow_from_the_encyclopedia_and_the_arithmetic():
    t = build_task(2)
    facts = {d["contents"] for d in corpus(t.entities)}
    for q in t.heldout + t.rl:
        if q.family == "python":
            expr = re.fullmatch(r"What is (.+)\?", q.question).group(1)
            assert str(eval(expr)) == q.answer  # noqa: S307 - generated arithmetic
        elif q.family == "search":
            attr, name = re.fullmatch(r"What is the (\w+) of (\w+)\?", q.question).groups()
            assert f"The {attr} of {name} is {q.answer}." in facts
        else:
            name, k = re.fullmatch(r"What is the population of (\w+) times (\d+)\?", q.question).groups()
            pop = next(e.population for e in t.entities if e.name == name)
            assert int(q.answer) == pop * int(k)


def test_written_files_and_trace_results_match_the_real_tools(tmp_path):
    from appo_trl.tools import build_tools
    from appo_trl.tools.search import format_results

    paths = write_task(tmp_path, seed=5, num_sft=9, num_rl=6, num_heldout=6)
    rows = {k: [json.loads(x) for x in open(paths[k])] for k in ("sft", "rl", "heldout", "corpus")}
    assert [len(rows[k]) for k in ("sft", "rl", "heldout")] == [9, 6, 6]
    assert len(rows["corpus"]) == 2 * (3 + 2 + 2)  # two facts per entity, entities per split: n/6 + 1
    assert set(rows["rl"][0]) >= {"prompt", "answer"} and set(rows["heldout"][0]) >= {"question", "answer"}
    # the <result> text of each trace is what the python sandbox prints / what the search tool formats
    python = build_tools(["python"], {})["python"]
    by_text = {d["contents"] for d in rows["corpus"]}
    for row in rows["sft"]:
        trace = row["messages"][-1]["content"]
        for code, out in re.findall(r"<python>(.*?)</python> <result>\n(.*?)\n</result>", trace):
            assert asyncio.run(python.call(code)).text == out
        for out in re.findall(r"</search> <result>\n(.*?)\n</result>", trace):
            assert out == format_results([out.removeprefix("Page 1: ")], 1) and out.removeprefix("Page 1: ") in by_text
    asyncio.run(python.aclose())


def test_name_syllables_never_occur_inside_the_fixed_text():
    """The demo tokenizer adds the syllables as tokens; they must not split any other word."""
    from appo_trl.synthetic.task import SYLLABLES, SYSTEM_PROMPT

    t = build_task(0)
    names = {e.name for e in t.entities} | {e.capital for e in t.entities}
    fixed = SYSTEM_PROMPT + " ".join(q.question + q.trace for q in t.sft[:60])
    for name in sorted(names, key=len, reverse=True):
        fixed = fixed.replace(name, " ")
    assert not [s for s in SYLLABLES if s in fixed]


def test_every_trace_query_finds_its_own_page_first(tmp_path):
    """The traces search `<name> <attr>` (the name first: `appo_trl.synthetic.task.search_question`); the real BM25
    index ranks the asked fact's own page strictly first for every entity and attribute of the task."""
    from appo_trl.tools.search_server import BM25Index

    t = build_task(2, num_sft=1800)
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in t.corpus))
    index = BM25Index(str(path))
    want = {d["contents"]: d["id"] for d in t.corpus}
    queries = {q.query for q in t.sft + t.rl + t.heldout if q.query}
    queries |= {f"{e.name} {attr}" for e in t.entities for attr in ("capital", "population")}
    queries = sorted(queries)
    wrong = []
    for query, hits in zip(queries, index.retrieve(queries, 2)):
        (top, score), (_, second) = hits[0], hits[1]
        name, attr = query.split()
        if want[top["contents"]] != f"{name}-{attr}" or not score > second:
            wrong.append((query, top["contents"]))
    assert not wrong, f"{len(wrong)} of {len(queries)} queries: {wrong[:3]}"


def test_both_traces_state_the_multiplier_after_the_entity_and_python_answers_have_3_or_4_digits():
    """`<think>Velmora population, times 7: ...` (`MULTIPLIER_MARKER`), then `print(452 * 7)`, in every both trace
    and guess; python values have 3 or 4 digits (`ANSWER_DIGITS`), as the other families' answers (run F)."""
    from appo_trl.synthetic.task import ANSWER_DIGITS, MULTIPLIER_MARKER

    t = build_task(0, num_sft=600)
    both = [q for q in t.sft + t.rl + t.heldout if q.family == "both"]
    for q in both:
        name, k = re.fullmatch(r"What is the population of (\w+) times (\d+)\?", q.question).groups()
        assert q.named == f"{name} population{MULTIPLIER_MARKER}{k}" and q.trace.startswith(f"<think>{q.named}: ")
        if "<result>" in q.trace:  # not a guess: the call writes the same k
            assert re.search(rf"<python>print\(\d+ \* {k}\)</python>", q.trace), q.trace
    assert sum("<result>" not in q.trace for q in both) > 20  # guesses state it too
    python = [q for q in t.sft + t.rl + t.heldout if q.family == "python"]
    assert {len(q.answer.lstrip("-")) for q in python} <= set(ANSWER_DIGITS) and len(python) > 300


class CopyingModel:
    """A stand-in for a causal LM under `multiplier_copy`'s greedy decoding: it writes the question's multiplier
    (`shift` 0) or the next digit (`shift` 1) after whatever it is fed."""

    training = False

    def __init__(self, tokenizer, shift: int):
        self.tok, self.shift = tokenizer, shift

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def generate(self, input_ids, attention_mask, max_new_tokens, **_):
        import torch

        rows = []
        for ids in input_ids.tolist():
            k = int(re.search(r"times (\d)\?", self.tok.decode(ids)).group(1)) + self.shift
            rows.append(ids + self.tok.encode(f" {k % 10})", add_special_tokens=False)[:max_new_tokens])
        width = max(len(r) for r in rows)
        return torch.tensor([r + [self.tok.pad_token_id] * (width - len(r)) for r in rows])


def test_the_multiplier_probe_counts_the_questions_k_at_both_places(tiny_tokenizer):
    from appo_trl.synthetic.copying import multiplier_copy

    qs = build_task(0, num_heldout=96).heldout
    right = multiplier_copy(CopyingModel(tiny_tokenizer, 0), tiny_tokenizer, qs)
    wrong = multiplier_copy(CopyingModel(tiny_tokenizer, 1), tiny_tokenizer, qs)
    assert right == {"questions": 32, "think": 1.0, "call": 1.0} and wrong["think"] == wrong["call"] == 0.0
    with pytest.raises(ValueError, match="needs both questions"):
        multiplier_copy(CopyingModel(tiny_tokenizer, 0), tiny_tokenizer, [q for q in qs if q.family != "both"])
