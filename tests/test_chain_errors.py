"""`appo_trl.synthetic.chain_errors`: one category per chain sample, and the table of a study's evaluations."""

from __future__ import annotations

import json
import re

import pytest

from appo_trl.synthetic import chain_errors as C
from appo_trl.synthetic.task import RESULT, build_task, write_task

ALL = ("python", "search", "both", "chain")
TASK = {"num_sft": 60, "num_rl": 8, "num_heldout": 24, "families": ALL}


@pytest.fixture(scope="module")
def task():
    return build_task(1, **TASK)


def _neighbours(task) -> dict[str, str]:
    return {e.name: e.neighbour for e in task.entities}


def _five_calls(task):
    """A held-out 5-call question and its chain (start, hop 1, hop 2)."""
    nb = _neighbours(task)
    for q in task.heldout:
        m = re.fullmatch(r"What is the population of the neighbour of the neighbour of (\w+) minus .*", q.question)
        if m:
            return q, (m[1], nb[m[1]], nb[nb[m[1]]])
    raise AssertionError("no 5-call chain question in the held-out split")


def _completion(*queries: str, answer: str = "1") -> str:
    calls = "".join(f"<search>{q}</search>{RESULT.format('Page 1: ...')}" for q in queries)
    return f"<think>I will follow the chain.</think>{calls}<answer>\\boxed{{{answer}}}</answer>"


def _miscopy(name: str) -> str:
    """The name with its tail syllable replaced ("Junvux" -> "Junyol"), as the cold-started model does."""
    return name[:-3] + ("yol" if not name.endswith("yol") else "zim")


def test_one_category_per_hand_made_sample(task):
    q, (e, h1, h2) = _five_calls(task)
    nb = _neighbours(task)
    right = [f"neighbour of {e}", f"neighbour of {h1}", f"population of {h2}", f"population of {e}"]
    cases = {
        "correct": (q.trace, True),
        "guessed without a tool": ("<think>I know it.</think><answer>\\boxed{12}</answer>", False),
        "mis-copied name": (_completion(right[0], f"neighbour of {_miscopy(h1)}", *right[2:]), False),
        "wrong hop": (_completion(right[0], f"population of {h1}", right[3]), False),  # the second hop skipped
        "stopped early": (_completion(*right[:3]), False),
        "right searches, wrong answer": (_completion(*reversed(right)), False),
    }
    assert set(cases) == set(C.CATEGORIES)
    for category, (completion, correct) in cases.items():
        assert C.classify(q.question, completion, correct, nb) == category, category


def test_order_and_reading_of_searches(task):
    q, (e, h1, h2) = _five_calls(task)
    nb = _neighbours(task)
    # a repeated search is off the chain (a repeated hop), even if every needed search follows
    twice = _completion(f"neighbour of {e}", f"neighbour of {e}", f"neighbour of {h1}", f"population of {h2}")
    assert C.classify(q.question, twice, False, nb) == "wrong hop"
    # the first search off the chain decides: a wrong name before a wrong hop is a mis-copied name
    first = _completion(f"neighbour of {_miscopy(e)}", f"population of {h1}")
    assert C.classify(q.question, first, False, nb) == "mis-copied name"
    # a query naming no entity at all is a wrong name
    assert C.classify(q.question, _completion("neighbour of"), False, nb) == "mis-copied name"
    # either word order and a capitalised attribute name the same step
    either = _completion(f"{e} neighbour", f"Neighbour of {h1}", f"population of {h2}", f"Population of {e}")
    assert C.classify(q.question, either, False, nb) == "right searches, wrong answer"
    # a correct answer is correct whatever its searches, and a python call alone is still a guess
    assert C.classify(q.question, _completion(f"capital of {e}"), True, nb) == "correct"
    python = "<python>print(3 - 1)</python>" + RESULT.format("2") + "<answer>\\boxed{2}</answer>"
    assert C.classify(q.question, python, False, nb) == "guessed without a tool"


def test_generated_traces_follow_the_chain():
    """Every generated correct trace makes exactly the searches `chain_searches` expects; the SFT traces that
    lose track (`chain_wrong_share`) skip a hop: a wrong hop (3 and 5 calls) or a missing search (4 calls)."""
    task = build_task(2, num_sft=240, num_rl=8, num_heldout=48, families=ALL, guess_share=0.0)
    nb = _neighbours(task)
    seen = {}
    for q in task.heldout + task.sft:
        if q.family != "chain":
            continue
        wrong = re.search(r"\\boxed\{(-?\d+)\}", q.trace)[1] != q.answer
        calls = len(C.chain_searches(q.question, nb)) + 1
        category = C.classify(q.question, q.trace, False, nb)
        expected = "right searches, wrong answer" if not wrong else "stopped early" if calls == 4 else "wrong hop"
        assert category == expected, (q.question, q.trace)
        seen[wrong, calls] = True
    assert len(seen) == 6  # each template, right and wrong


def test_bad_questions_are_refused(task):
    nb = _neighbours(task)
    with pytest.raises(ValueError, match="not a chain question"):
        C.chain_searches("What is 3 + 4?", nb)
    with pytest.raises(ValueError, match="no neighbour link"):
        C.chain_searches("What is the population of the neighbour of Nobody times 3?", nb)


def _write_eval(out, heldout, completions: dict[int, tuple[str, bool]]) -> None:
    """samples.jsonl and predictions.jsonl of an evaluation with one sample per question in `completions`."""
    out.mkdir(parents=True)
    samples = [{"index": i, "sample": 0, "completion": c} for i, (c, _) in completions.items()]
    preds = [{"index": i, "sample": 0, "scores": {"em": float(ok)}} for i, (_, ok) in completions.items()]
    for name, rows in (("samples", samples), ("predictions", preds)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _workdir(tmp_path) -> list[int]:
    """A study work dir with SFT and grpo seed-0 evaluations of the tiny task; returns the chain rows' indices."""
    write_task(tmp_path / "data", 1, **TASK)
    task = build_task(1, **TASK)
    chain = [i for i, q in enumerate(task.heldout) if q.family == "chain"]
    other = next(i for i, q in enumerate(task.heldout) if q.family != "chain")
    guess = "<think>I know it.</think><answer>\\boxed{1}</answer>"
    # SFT: the first chain question right, the others guessed; a non-chain question must not count
    sft = {i: (task.heldout[i].trace, True) if i == chain[0] else (guess, False) for i in chain}
    _write_eval(tmp_path / "eval" / "sft", task.heldout, {**sft, other: (guess, False)})
    # an RL run: step 40 all guessed, step 80 (the last) all right; an unfinished step 120 has no predictions
    run = tmp_path / "eval" / "grpo" / "seed0"
    _write_eval(run / "step40", task.heldout, {i: (guess, False) for i in chain})
    _write_eval(run / "step80", task.heldout, {i: (task.heldout[i].trace, True) for i in chain})
    (run / "step120").mkdir()
    return chain


def test_error_table_reads_a_study_workdir(tmp_path, capsys):
    chain = _workdir(tmp_path)

    t = C.error_table(tmp_path)
    assert t["samples"] == len(chain) and t["dirs"] == ["sft"]
    assert t["counts"]["correct"] == 1 and t["counts"]["guessed without a tool"] == len(chain) - 1
    assert sum(t["shares"].values()) == pytest.approx(1.0)
    rl = C.error_table(tmp_path, "grpo")
    assert rl["dirs"] == ["grpo/seed0/step80"] and rl["shares"]["correct"] == 1.0
    assert C.error_table(tmp_path, "grpo", step=40)["shares"]["guessed without a tool"] == 1.0

    assert C.main([str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in table[2:]] == ["| SFT", "| grpo"]
    assert table[3].endswith("| 100 % | 0 % | 0 % | 0 % | 0 % | 0 % | " + f"{len(chain)} | grpo/seed0/step80 |")
    with pytest.raises(SystemExit) as exit_:
        C.main([str(tmp_path), "--variants", "appo"])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr().err == f"chain_errors: error: no finished evaluation of appo under {tmp_path / 'eval'}\n"
    )


def test_the_study_table_reads_the_finished_runs_at_step_k(tmp_path):
    from appo_trl.cli.study import chain_error_tables

    _workdir(tmp_path)
    done = {
        "summary": {"grpo": {}},
        "runs": {"grpo/seed0": {"strategy": "grpo", "seed": 0}},
        "config": {"rl_steps": 40},
    }
    tables = chain_error_tables(done, tmp_path)
    assert list(tables) == ["SFT", "grpo"] and tables["grpo"]["dirs"] == ["grpo/seed0/step40"]
    done["runs"]["grpo/seed1"] = {"strategy": "grpo", "seed": 1}  # a finished run must have its evaluation
    with pytest.raises(FileNotFoundError, match="no finished evaluation at step 40 in .*seed1"):
        chain_error_tables(done, tmp_path)


def test_the_cli_lists_variants_in_the_order_of_the_study(tmp_path, capsys):
    import json
    import shutil

    _workdir(tmp_path)
    shutil.copytree(tmp_path / "eval" / "grpo", tmp_path / "eval" / "appo+tree")
    (tmp_path / "study.json").write_text(json.dumps({"config": {"strategies": ["grpo", "appo+tree"]}}))
    assert C.main([str(tmp_path)]) == 0
    rows = [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == ["| SFT", "| grpo", "| appo+tree"]  # not the alphabetical order
