"""Benchmark registry and ARPO-format loaders (ARPO's own files load unchanged)."""

import json

import pytest

from appo_trl.evaluation.benchmarks import (
    DATA_ROOT_ENV,
    load_examples,
    load_registry,
    parse_row,
    system_prompt,
)

# name -> (rows, first gold, question field) as in ARPO's files
ARPO_FILES = {
    "aime24": (30, "204", "problem"), "aime25": (30, "70", "problem"), "math500": (500, None, "question"),
    "gsm8k": (1319, "18", "question"), "hotpotqa": (200, "Frank Lowy", "question"),
    "2wiki": (200, "the five boroughs", "question"), "musique": (200, "passes over the Rio di Palazzo", "question"),
    "bamboogle": (125, "james madison", "question"), "webwalker": (200, None, "question"),
    "gaia": (103, "34689", "Question"), "simpleqa": (500, "Michio Sugeno", "question"),
    "xbench": (100, "161.27元", "question"),
}  # fmt: skip


def test_registry_has_all_arpo_benchmarks():
    reg = load_registry()
    assert set(reg) == set(ARPO_FILES)
    assert reg["aime24"].task == "math" and reg["aime24"].tools == ["python"]
    assert reg["gsm8k"].answer_format == "gsm8k"
    assert reg["hotpotqa"].resolved_metrics(judge=False) == ("f1", "cover_em")
    assert reg["gaia"].resolved_metrics(judge=True) == ("llm_judge", "llm_judge")
    assert reg["gaia"].resolved_metrics(judge=False) == ("cover_em", "cover_em")
    # webwalker falls back to F1 for its score but needs a 0/1 metric for pass@k
    assert reg["webwalker"].resolved_metrics(judge=False) == ("f1", "cover_em")


@pytest.mark.parametrize("name", sorted(ARPO_FILES))
def test_arpo_files_load_unchanged(name, arpo_data_dir):
    bench = load_registry()[name]
    examples = load_examples(bench, f"{arpo_data_dir}/eval")
    rows, first_gold, _ = ARPO_FILES[name]
    assert len(examples) == rows
    assert all(ex.question and ex.answers for ex in examples)
    assert [ex.index for ex in examples] == list(range(rows))
    if first_gold is not None:
        assert examples[0].answers[0] == first_gold


def test_data_root_from_env(arpo_data_dir, monkeypatch):
    monkeypatch.setenv(DATA_ROOT_ENV, f"{arpo_data_dir}/eval")
    assert len(load_examples(load_registry()["bamboogle"], limit=3)) == 3
    monkeypatch.delenv(DATA_ROOT_ENV)
    with pytest.raises(FileNotFoundError, match="data_root"):
        load_examples(load_registry()["bamboogle"])


def test_parse_row_formats():
    assert parse_row({"Question": "q", "answer": "a"}, 0).answers == ["a"]
    assert parse_row({"problem": "p", "answer": 70}, 0).answers == ["70"]  # aime25 integers
    assert parse_row({"question": "q", "answer": ["x", " y ", ""]}, 0).answers == ["x", "y"]
    gsm = parse_row({"question": "q", "answer": "6 * 2 = <<6*2=12>>12\n#### 1,234"}, 0, "gsm8k")
    assert gsm.answers == ["1234"]
    with pytest.raises(KeyError, match="found \\['prompt'\\]"):
        parse_row({"prompt": "q"}, 3, source="x.jsonl")


def test_custom_registry_and_errors(tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text(json.dumps({"question": "2+2?", "answer": ["4"]}) + "\n\n", encoding="utf-8")
    reg_file = tmp_path / "reg.yaml"
    reg_file.write_text(
        f"tasks:\n  math: {{metric: math_equal, pass_metric: math_equal, tools: [python]}}\n"
        f"benchmarks:\n  mine: {{path: {data}, task: math, prompt: tir_python}}\n",
        encoding="utf-8",
    )
    bench = load_registry(reg_file)["mine"]
    assert [e.answers for e in load_examples(bench)] == [["4"]]  # absolute path: no data root needed
    reg_file.write_text("tasks: {math: {}}\nbenchmarks:\n  bad: {path: x, task: chess}\n", encoding="utf-8")
    with pytest.raises(ValueError, match="unknown task 'chess'"):
        load_registry(reg_file)
    reg_file.write_text("tasks: {math: {}}\nbenchmarks:\n  bad: {path: x, task: math, metrc: f1}\n", encoding="utf-8")
    with pytest.raises(ValueError, match="metrc"):
        load_registry(reg_file)


def test_prompt_styles():
    code_search = system_prompt("code_search")
    assert code_search.startswith("You are a helpful assistant that can solve the given question step by step")
    assert "\\boxed{answer here}" in code_search and "\x08" not in code_search
    assert "<python>" in system_prompt("tir_python")  # a name from appo_trl.data.SYSTEM_PROMPTS
    assert system_prompt("Answer briefly.") == "Answer briefly."
    assert system_prompt(None) is None
