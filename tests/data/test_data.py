"""`appo_trl.data`: sources, mixtures, ARPO's RL parquet schema, column mapping, sharegpt conversion."""

import json
from types import SimpleNamespace

import pytest

from appo_trl.data import (
    SYSTEM_PROMPTS,
    DatasetColumnError,
    load_rl_dataset,
    load_sft_dataset,
    parse_sources,
    repair_text,
    sharegpt_to_messages,
)


def _args(dataset_name, **kw):
    base = dict(
        dataset_name=dataset_name,
        prompt_column="prompt",
        answer_column="answer",
        system_prompt=None,
        dataset_train_split="train",
        dataset_config=None,
    )
    return SimpleNamespace(**{**base, **kw})


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_parse_sources_string_mapping_list():
    assert [(s.path, s.weight) for s in parse_sources("a.parquet")] == [("a.parquet", 1.0)]
    assert [(s.path, s.weight) for s in parse_sources("a.parquet@0.5, org/ds@2")] == [
        ("a.parquet", 0.5),
        ("org/ds", 2.0),
    ]
    assert [(s.path, s.weight) for s in parse_sources({"a": 0.25, "b": 1})] == [("a", 0.25), ("b", 1.0)]
    assert [(s.path, s.weight) for s in parse_sources(["a", {"path": "b", "weight": 3}])] == [("a", 1.0), ("b", 3.0)]
    with pytest.raises(ValueError, match="weight > 0"):
        parse_sources("a@0")
    with pytest.raises(ValueError, match="dataset_name"):
        parse_sources(None)


def test_repair_backspace():
    assert repair_text("enclosed within \x08oxed{} with latex") == "enclosed within \\boxed{} with latex"
    assert repair_text("no defect \\boxed{x}") == "no defect \\boxed{x}"


def test_string_prompt_gets_system_prompt_and_passthrough_columns(tmp_path):
    path = _jsonl(
        tmp_path / "d.jsonl",
        [
            {"question": "What is 2+2?", "gold": ["4", "four"], "ability": "math", "data_source": "toy", "x": 1},
            {"question": "Capital of France?", "gold": ["Paris"], "ability": "qa", "data_source": "toy", "x": 2},
        ],
    )
    ds = load_rl_dataset(_args(path, prompt_column="question", answer_column="gold", system_prompt="tir"))
    assert ds.column_names == ["prompt", "answer", "ability", "data_source"]
    assert ds[0]["prompt"] == [
        {"role": "system", "content": SYSTEM_PROMPTS["tir"]},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert ds[0]["answer"] == ["4", "four"] and ds[1]["ability"] == "qa"
    literal = load_rl_dataset(_args(path, prompt_column="question", answer_column="gold", system_prompt="Be brief."))
    assert literal[1]["prompt"][0] == {"role": "system", "content": "Be brief."}


def test_missing_column_error_names_column_and_columns_found(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DatasetColumnError) as err:
        load_rl_dataset(_args(path))
    msg = str(err.value)
    assert "'prompt'" in msg and "['answer', 'question']" in msg and "prompt_column" in msg
    with pytest.raises(DatasetColumnError, match="no answer column 'gold'"):
        load_rl_dataset(_args(path, prompt_column="question", answer_column="gold"))


def test_mixture_weights_and_answer_types(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "answer": str(i)} for i in range(10)])
    b = _jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "answer": [str(i), "x"]} for i in range(4)])
    ds = load_rl_dataset(_args({a: 0.5, b: 2.0}))
    prompts = [r["prompt"][0]["content"] for r in ds]
    assert len(ds) == 5 + 8
    assert sum(p.startswith("a") for p in prompts) == 5 and len({p for p in prompts if p.startswith("a")}) == 5
    assert sorted(p for p in prompts if p.startswith("b")) == sorted([f"b{i}" for i in range(4)] * 2)
    assert all(isinstance(r["answer"], list) for r in ds)  # str answers upcast to [str] in a mixed mixture
    assert load_rl_dataset(_args(f"{a}@0.5,{b}@2"))["prompt"] == ds["prompt"]  # string form, same seed


def test_folder_and_missing_split(tmp_path):
    _jsonl(tmp_path / "train.jsonl", [{"prompt": "p", "answer": "1"}])
    _jsonl(tmp_path / "test.jsonl", [{"prompt": "t", "answer": "2"}, {"prompt": "u", "answer": "3"}])
    assert len(load_rl_dataset(_args(str(tmp_path)))) == 1
    assert len(load_rl_dataset(_args(str(tmp_path), dataset_train_split="test"))) == 2
    with pytest.raises(ValueError, match="available splits"):
        load_rl_dataset(_args(str(tmp_path), dataset_train_split="validation"))
    with pytest.raises(FileNotFoundError):
        load_rl_dataset(_args(str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="only provides the 'train' split"):
        load_rl_dataset(_args(str(tmp_path / "train.jsonl")), split="test")


@pytest.mark.parametrize(
    "name,rows,ability", [("valid.parquet", 180, {"math", "qa"}), ("hard_search_1k.parquet", 1071, {None})]
)
def test_arpo_rl_parquet_loads_as_is(arpo_data_dir, name, rows, ability):
    import pyarrow.parquet as pq

    path = f"{arpo_data_dir}/rl/{name}"
    raw = pq.read_table(path).to_pylist()
    assert "\x08oxed" in raw[0]["prompt"][0]["content"]  # the defect is really in the file
    ds = load_rl_dataset(_args(path))
    assert len(ds) == rows and set(ds["ability"]) == ability
    assert ds.column_names == ["prompt", "answer", "ability", "data_source"]
    row = ds[3]
    assert row["answer"] == raw[3]["reward_model"]["ground_truth"]
    assert row["data_source"] == raw[3]["data_source"]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["prompt"][1]["content"] == raw[3]["prompt"][1]["content"]
    system = row["prompt"][0]["content"]
    assert "\x08" not in system and "\\boxed{answer here}" in system
    assert system == raw[3]["prompt"][0]["content"].replace("\x08", "\\b")


def test_arpo_mixture_of_two_schemas(arpo_data_dir):
    rl = f"{arpo_data_dir}/rl"
    ds = load_rl_dataset(_args({f"{rl}/valid.parquet": 1.0, f"{rl}/gaia_test.parquet": 1.0}))
    assert len(ds) == 180 + 103
    assert set(ds["data_source"]) == {"DR_grpo_mix", "DR_gaia"}


def test_sharegpt_conversion(tmp_path):
    row = {
        "system": "sys \x08oxed",
        "conversations": [
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "<think>t</think><answer>a</answer>"},
        ],
    }
    assert sharegpt_to_messages(row) == [
        {"role": "system", "content": "sys \\boxed"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>t</think><answer>a</answer>"},
    ]
    with pytest.raises(ValueError, match="Unknown sharegpt role 'bot'"):
        sharegpt_to_messages({"conversations": [{"from": "bot", "value": "x"}]})
    path = _jsonl(tmp_path / "s.jsonl", [row])
    ds = load_sft_dataset(path)
    assert ds.column_names == ["messages"] and ds[0]["messages"][2]["role"] == "assistant"
    msgs = _jsonl(
        tmp_path / "m.jsonl",
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
    )
    assert load_sft_dataset(msgs, system_prompt="S")[0]["messages"][0] == {"role": "system", "content": "S"}
    bad = _jsonl(tmp_path / "b.jsonl", [{"text": "x"}])
    with pytest.raises(DatasetColumnError, match="columns found: \\['text'\\]"):
        load_sft_dataset(bad)
