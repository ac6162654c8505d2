"""`appo_trl.synthetic.python_errors`: each python-family (and both-family) sample in one category, by hand."""

from __future__ import annotations

import json

import pytest

from appo_trl.synthetic.python_errors import classify, classify_both, dump_samples, eval_samples, main, table

Q, A = "What is 56 + 3 - 7?", "52"


def trace(expr: str, printed: str, boxed: str, think: str = "I will compute it with python.") -> str:
    return (f"<think>{think}</think><python>print({expr})</python> <result>\n{printed}\n</result>"
            f"<answer>\\boxed{{{boxed}}}</answer>")  # fmt: skip


@pytest.mark.parametrize(
    ("completion", "category"),
    [
        (trace("56 + 3 - 7", "52", "52"), "correct"),
        ("<think>I know it.</think><answer>\\boxed{57}</answer>", "guessed without a tool"),
        (trace("56 + 3 * 7", "77", "77"), "expression mis-copied"),
        (trace("56+3-7", "52", "57"), "result mis-copied"),  # spaces do not matter, the box does
        (trace("56 + 3 - 7", "52", "52") + "<python>print(1)</python>", "correct"),  # em reads the last box
        (trace("56 + 3 - 7", "52", "5").replace("<answer>", "<python>print(5)</python><answer>"), "other"),
    ],
)
def test_classify(completion, category):
    assert classify(Q, A, completion) == category


def test_table_shares_and_bad_format():
    samples = [(Q, A, trace("56 + 3 - 7", "52", "52")), (Q, A, trace("56 + 3 - 7", "52", "57")),
               (Q, A, "<answer>\\boxed{52}</answer>"), (Q, A, trace("56 - 3 - 7", "46", "46"))]  # fmt: skip
    t = table(samples)
    # the third is right for the evaluation (em) but has no <think>: the training reward scores it -1
    assert t["correct"] == 0.5 and t["result mis-copied"] == 0.25 and t["expression mis-copied"] == 0.25
    assert t["bad format"] == 0.25 and t["samples"] == 4


def test_reads_a_demo_eval_dir_and_a_dump(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    rows = [{"question": Q, "answer": [A], "family": "python"},
            {"question": "What is the capital of Zorvex?", "answer": ["Kip"], "family": "search"}]  # fmt: skip
    (tmp_path / "data" / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    step = tmp_path / "eval" / "step0"
    step.mkdir(parents=True)
    recs = [{"index": 0, "completion": trace("56 + 3 - 7", "52", "57")}, {"index": 1, "completion": "x"}]
    (step / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert eval_samples(step) == [(Q, A, recs[0]["completion"])]  # the search question is not a python one
    dump = tmp_path / "rollouts"
    dump.mkdir()
    groups = [
        {"prompt": Q, "answer": A, "rows": [{"completion": trace("56 + 3 - 7", "52", "52")}]},
        {"prompt": "What is the population of Zorvex times 3?", "answer": "9", "rows": [{"completion": "y"}]},
    ]
    (dump / "step_3.jsonl").write_text("".join(json.dumps(g) + "\n" for g in groups))
    assert dump_samples(dump) == [(Q, A, groups[0]["rows"][0]["completion"])]
    assert dump_samples(dump, range(4, 9)) == []
    assert main([str(step), str(dump)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "result mis-copied 100 %" in out[0] and "correct 100 %" in out[1]
    with pytest.raises(SystemExit):
        main([str(tmp_path)])
    assert "holds neither samples.jsonl nor rollouts" in capsys.readouterr().err


BQ, BA = "What is the population of Zorvex times 7?", "3164"  # population 452


def both(query: str, call: str, printed: str, boxed: str) -> str:
    return (f"<think>Zorvex population, times 7: I will search, then compute.</think><search>{query}</search>"
            f" <result>\nPage 1: The population of Zorvex is 452.\n</result><python>print({call})</python>"
            f" <result>\n{printed}\n</result><answer>\\boxed{{{boxed}}}</answer>")  # fmt: skip


@pytest.mark.parametrize(
    ("completion", "category"),
    [
        (both("Zorvex population", "452 * 7", "3164", "3164"), "correct"),
        (
            "<think>Zorvex population, times 7: I know it.</think><answer>\\boxed{3000}</answer>",
            "guessed without a tool",
        ),
        (both("Zorjun population", "452 * 7", "3164", "316"), "entity mis-copied"),
        (both("Zorvex population", "425 * 7", "2975", "2975"), "population mis-copied"),
        (both("Zorvex population", "452 * 8", "3616", "3616"), "multiplier mis-copied"),
        (both("Zorvex population", "452 * 7", "3164", "3146"), "result mis-copied"),
        (both("Zorvex population", "452 + 7", "459", "459"), "other"),
    ],
)
def test_classify_both(completion, category):
    assert classify_both(BQ, BA, completion) == category


def test_the_both_family_is_read_from_an_eval_dir_and_a_dump(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    rows = [{"question": Q, "answer": [A], "family": "python"}, {"question": BQ, "answer": [BA], "family": "both"}]
    (tmp_path / "data" / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    step = tmp_path / "eval" / "step0"
    step.mkdir(parents=True)
    wrong_k = both("Zorvex population", "452 * 8", "3616", "3616")
    recs = [{"index": 0, "completion": "x"}, {"index": 1, "completion": wrong_k}]
    (step / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert eval_samples(step, "both") == [(BQ, BA, wrong_k)]
    dump = tmp_path / "rollouts"
    dump.mkdir()
    groups = [
        {"prompt": Q, "answer": A, "rows": [{"completion": "y"}]},
        {"prompt": BQ, "answer": BA, "rows": [{"completion": wrong_k}, {"completion": "z", "role": "chain"}]},
    ]
    (dump / "step_1.jsonl").write_text("".join(json.dumps(g) + "\n" for g in groups))  # fmt: skip
    assert dump_samples(dump, family="both") == [(BQ, BA, wrong_k)] and len(dump_samples(dump)) == 1
    assert table(dump_samples(dump, family="both"), "both")["multiplier mis-copied"] == 1.0
    assert main([str(step), "--family", "both"]) == 0
    assert "multiplier mis-copied 100 %" in capsys.readouterr().out
