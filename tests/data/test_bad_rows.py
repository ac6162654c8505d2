"""Bad rows are found while the data loads, before the model does, each in one line naming the file and the row.

Before: an empty prompt trained silently, a null prompt gave `TypeError: 'NoneType' object is not iterable`, a
prompt longer than the model's limit stopped the run at step 2 naming no row, and malformed JSON or non-UTF-8
bytes gave 60-81-line tracebacks from `datasets`.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from appo_trl.configs.errors import DataError
from appo_trl.data import load_rl_dataset, load_sft_dataset


def _args(path, **kw):
    base = dict(dataset_name=str(path), prompt_column="prompt", answer_column="answer", system_prompt=None,
                dataset_train_split="train", dataset_config=None)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def _write(path, lines: list[str | bytes]) -> str:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return str(path)


def row(prompt, answer="1") -> str:
    return json.dumps({"prompt": prompt, "answer": answer})


GOOD = [row("What is 1+0?"), row("What is 2+0?", "2")]


@pytest.mark.parametrize(
    "bad,expected",
    [
        (row("   \n"), "row 1: the prompt is empty or whitespace only"),
        (row(""), "row 1: the prompt is empty or whitespace only"),
        (row(None), "row 1: the prompt is null"),
    ],
)
def test_null_or_empty_string_prompt_names_file_and_row(tmp_path, bad, expected):
    path = _write(tmp_path / "d.jsonl", [GOOD[0], bad, GOOD[1]])
    with pytest.raises(DataError) as info:
        load_rl_dataset(_args(path))
    assert str(info.value) == f"{path}, {expected}; fix the data, or set skip_bad_rows: true to drop such rows."


def test_empty_message_prompt_names_the_row(tmp_path):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": " "}]
    good = [{"role": "user", "content": "hi"}]
    path = _write(tmp_path / "m.jsonl", [row(good), row(good), row(msgs)])
    with pytest.raises(DataError, match=r"m.jsonl, row 2: the prompt is empty or whitespace only \(no message text\)"):
        load_rl_dataset(_args(path))


def test_a_prompt_too_long_for_the_model_names_row_and_length(tmp_path, tiny_tokenizer):
    path = _write(tmp_path / "d.jsonl", [*GOOD, row("seven " * 300), row("eight " * 400)])
    limit = (200, "the model's max_position_embeddings")
    with pytest.raises(DataError) as info:
        load_rl_dataset(_args(path), tokenizer=tiny_tokenizer, max_prompt_tokens=limit)
    text = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "seven " * 300}], tokenize=False,
                                              add_generation_prompt=True)  # fmt: skip
    n = len(tiny_tokenizer(text, add_special_tokens=False)["input_ids"])
    assert n >= 200
    assert str(info.value).startswith(
        f"{path}, row 2: the prompt is too long ({n} tokens with the chat template; the model's "
        "max_position_embeddings = 200) (1 more bad rows); "
    )
    # the limit counts the system prompt the recipe adds
    short = _write(tmp_path / "s.jsonl", GOOD)
    assert len(load_rl_dataset(_args(short), tokenizer=tiny_tokenizer, max_prompt_tokens=limit)) == 2
    with pytest.raises(DataError, match="row 0: the prompt is too long"):
        load_rl_dataset(_args(short, system_prompt="x " * 300), tokenizer=tiny_tokenizer, max_prompt_tokens=limit)


def test_malformed_json_line_names_the_line(tmp_path):
    path = _write(tmp_path / "d.jsonl", [GOOD[0], '{"prompt": "What is 3+0?", "answer": "3"', GOOD[1]])
    with pytest.raises(DataError) as info:
        load_rl_dataset(_args(path))
    assert str(info.value).startswith(f"{path}, line 2: malformed JSON (Expecting ',' delimiter, column 41)")


def test_non_utf8_bytes_name_the_line(tmp_path):
    path = _write(tmp_path / "d.jsonl", [GOOD[0], GOOD[1], b'{"prompt": "caf\xe9?", "answer": "1"}'])
    with pytest.raises(DataError) as info:
        load_rl_dataset(_args(path))
    assert str(info.value).startswith(f"{path}, line 3: not UTF-8 (byte 0xe9 at column 16)")


def test_a_malformed_json_array_names_line_and_column(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[{"prompt": "a", "answer": "1"},\n {"prompt": "b" "answer": "2"}]')
    with pytest.raises(DataError, match=r"d.json, line 2: malformed JSON \(Expecting ',' delimiter, column 17\)"):
        load_rl_dataset(_args(str(path)))


def test_sft_data_files_are_checked_too(tmp_path):
    path = _write(tmp_path / "sft.jsonl", ['{"messages": [}'])
    with pytest.raises(DataError, match=r"sft.jsonl, line 1: malformed JSON"):
        load_sft_dataset(path)


def test_skip_bad_rows_drops_counts_and_logs_them(tmp_path, tiny_tokenizer, caplog):
    lines = [
        GOOD[0],
        "{not json",
        row(None),
        b'{"prompt": "\xff", "answer": "1"}',
        row("  "),
        row("long " * 400),
        GOOD[1],
    ]
    path = _write(tmp_path / "d.jsonl", lines)
    with caplog.at_level(logging.WARNING):
        ds = load_rl_dataset(_args(path, skip_bad_rows=True), tokenizer=tiny_tokenizer,
                             max_prompt_tokens=(200, "vllm_max_model_length"))  # fmt: skip
    assert [m[-1]["content"] for m in ds["prompt"]] == ["What is 1+0?", "What is 2+0?"]
    logs = [r.getMessage() for r in caplog.records if "skip_bad_rows" in r.getMessage()]
    assert logs == [
        f"skip_bad_rows: skipped 2 bad line(s) of {path} (1 malformed JSON, 1 not UTF-8): lines 2, 4",
        f"skip_bad_rows: skipped 3 bad row(s) of {path} (1 the prompt is null, 1 the prompt is empty or whitespace "
        "only, 1 the prompt is too long): rows 1, 2, 3",
    ]


def test_skip_bad_rows_with_nothing_left_is_an_error(tmp_path):
    path = _write(tmp_path / "d.jsonl", [row(""), row(None)])
    with pytest.raises(DataError, match="every row is bad"):
        load_rl_dataset(_args(path, skip_bad_rows=True))


def test_appo_train_stops_on_a_long_prompt_before_the_model_loads(tmp_path, tiny_model_path, capfd, monkeypatch):
    """`appo train`: the limit is the model config's max_position_embeddings (2048 for the tiny model); the
    error is one line on stderr, exit code 2, and APPOTrainer (the model load) is never reached."""
    import yaml

    from appo_trl.cli import main as appo
    from appo_trl.trainer import trainer as trainer_module

    def no_model(*a, **kw):
        raise AssertionError("the model was loaded before the data check")

    monkeypatch.setattr(trainer_module.APPOTrainer, "__init__", no_model)
    data = _write(tmp_path / "d.jsonl", [*GOOD, row("many words " * 2000)])
    recipe = {"model_name_or_path": tiny_model_path, "dataset_name": data, "output_dir": str(tmp_path / "out"),
              "use_cpu": True, "report_to": "none", "num_generations": 2, "per_device_train_batch_size": 2,
              "max_steps": 1, "reward_funcs": ["format"]}  # fmt: skip
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert appo(["train", "--config", str(tmp_path / "r.yaml")]) == 2
    err = [x for x in capfd.readouterr().err.splitlines() if x.strip() and "examples/s]" not in x and "%|" not in x]
    assert len(err) == 1 and err[0].startswith(f"appo train: error: {data}, row 2: the prompt is too long ("), err
    assert "the model's max_position_embeddings = 2048)" in err[0]


def _server_recipe(tmp_path, model, data, **extra) -> str:
    import yaml

    recipe = {"model_name_or_path": model, "dataset_name": data, "output_dir": str(tmp_path / "out"),
              "use_cpu": True, "report_to": "none", "num_generations": 2, "per_device_train_batch_size": 2,
              "max_steps": 1, "reward_funcs": ["format"], "use_vllm": True, "vllm_mode": "server", **extra}  # fmt: skip
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    return str(tmp_path / "r.yaml")


def _stderr_lines(capfd) -> list[str]:
    return [x for x in capfd.readouterr().err.splitlines() if x.strip() and "examples/s]" not in x and "%|" not in x]


def test_vllm_server_mode_checks_prompts_against_the_served_max_model_len(
    tmp_path, tiny_model_path, tiny_tokenizer, capfd, monkeypatch
):
    """vLLM server mode: a server that answers at start-up serves a `max_model_len` (here 256) smaller than the
    model's 2048; a prompt of 256 to 2047 tokens stops `appo train` there, in one line naming the file, the row and the
    server, before the model loads (it used to pass and stop the run when the sampler first met it)."""
    from appo_trl.cli import main as appo
    from appo_trl.trainer import trainer as trainer_module

    fake_vllm = pytest.importorskip("bench.fake_vllm")

    def no_model(*a, **kw):
        raise AssertionError("the model was loaded before the data check")

    monkeypatch.setattr(trainer_module.APPOTrainer, "__init__", no_model)
    data = _write(tmp_path / "d.jsonl", [*GOOD, row("many words " * 60)])
    text = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "many words " * 60}], tokenize=False,
                                              add_generation_prompt=True)  # fmt: skip
    assert 256 <= len(tiny_tokenizer(text, add_special_tokens=False)["input_ids"]) < 2048  # fits the model's limit
    policy = fake_vllm.ScriptedPolicy(tiny_tokenizer, lambda ctx, rng: [tiny_tokenizer.eos_token_id])
    with fake_vllm.FakeVLLMServer(policy, tiny_tokenizer, max_model_len=256) as server:
        assert appo(["train", "--config", _server_recipe(tmp_path, tiny_model_path, data,
                                                         vllm_server_base_url=server.url)]) == 2  # fmt: skip
        err = _stderr_lines(capfd)
        assert len(err) == 1 and err[0].startswith(f"appo train: error: {data}, row 2: the prompt is too long ("), err
        assert f"the vLLM server's max_model_len at {server.url} = 256)" in err[0]
        # a vllm_max_model_length the server does not serve is one line too
        assert appo(["train", "--config", _server_recipe(tmp_path, tiny_model_path, data, vllm_max_model_length=512,
                                                         vllm_server_base_url=server.url)]) == 2  # fmt: skip
        err = _stderr_lines(capfd)
        assert err == [f"appo train: error: vllm_max_model_length=512 but the vLLM server at {server.url} serves "
                       "max_model_len=256: set them equal (or leave vllm_max_model_length unset to use the server's). "
                       "(run with --debug for the traceback)"]  # fmt: skip


def test_an_unreachable_vllm_server_leaves_the_model_limit(tmp_path):
    """No server answers at start-up (it may still be loading): the limit is what it was without one."""
    import socket

    from appo_trl.configs.preflight import prompt_token_limit, served_max_model_len

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = SimpleNamespace(use_vllm=True, vllm_mode="server", vllm_server_base_url=f"http://127.0.0.1:{port}",
                           vllm_max_model_length=300, trust_remote_code=False)  # fmt: skip
    assert served_max_model_len(args) is None
    assert prompt_token_limit(args, SimpleNamespace()) == (300, "vllm_max_model_length")
