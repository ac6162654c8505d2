"""SFT stage: the exact loss mask (assistant tokens outside `<result>` spans), training, LoRA, packing."""

import json

import pytest
import torch

from appo_trl.configs.recipes import REPO_ROOT, parse_recipe
from appo_trl.stages.sft import dataclass_types, result_spans, tokenize_conversation

RECIPE = str(REPO_ROOT / "recipes" / "tiny" / "sft.yaml")
TRACE = "<think>a</think><python>x</python><result>\n7\n</result><answer>7</answer>"
MESSAGES = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "q"},
    {"role": "assistant", "content": TRACE},
]


def _pieces(tok, out):
    return [(tok.decode([i]), m) for i, m in zip(out["input_ids"], out["assistant_masks"])]


def test_result_spans():
    text = "a<result>x</result>b<result>y</result>c<result>open"
    spans = result_spans(text)
    assert [text[s:e] for s, e in spans] == ["<result>x</result>", "<result>y</result>", "<result>open"]


def test_mask_is_exactly_assistant_tokens_outside_results(tiny_tokenizer):
    out = tokenize_conversation(MESSAGES, tiny_tokenizer)
    pieces = _pieces(tiny_tokenizer, out)
    prompt = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    n_prompt = len(tiny_tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert all(m == 0 for _, m in pieces[:n_prompt])  # system, user and the assistant header: never trained
    assert pieces[n_prompt:] == [  # hand-checked, token by token
        ("<think>", 1),
        ("a", 1),
        ("</think>", 1),
        ("<python>", 1),
        ("x", 1),
        ("</python>", 1),
        ("<result>", 0),
        ("\n", 0),
        ("7", 0),
        ("\n", 0),
        ("</result>", 0),
        ("<answer>", 1),
        ("7", 1),
        ("</answer>", 1),
        ("<|im_end|>", 1),
        ("\n", 0),
    ]
    unmasked = tokenize_conversation(MESSAGES, tiny_tokenizer, mask_tool_results=False)["assistant_masks"]
    assert unmasked == [0] * n_prompt + [1] * 15 + [0]
    full = tokenize_conversation(MESSAGES, tiny_tokenizer, assistant_only_loss=False)["assistant_masks"]
    assert full == [1] * (n_prompt + 6) + [0] * 5 + [1] * 5


def test_result_tags_outside_assistant_and_multi_piece_tags(tiny_tokenizer):
    # A "<result>" mentioned in the system prompt is not an assistant span; tags that are not single tokens
    # are masked wherever a token overlaps them.
    messages = [
        {"role": "system", "content": "results come in <result> tags"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "go [[OUT 42 OUT]] done"},
    ]
    out = tokenize_conversation(
        messages, tiny_tokenizer, assistant_only_loss=False, open_tag="[[OUT", close_tag="OUT]]"
    )
    trained = tiny_tokenizer.decode([i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m])
    assert "42" not in trained and "[[" not in trained and "]]" not in trained
    assert "results come in <result> tags" in trained and "go" in trained and "done" in trained


def test_no_generation_markers_is_an_error(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="generation"):
        tokenize_conversation(MESSAGES, tok)


def _run(tiny_model_path, out, *extra):
    from appo_trl.stages.sft import main

    args = parse_recipe(
        dataclass_types(),
        ["--config", RECIPE, "--model_name_or_path", tiny_model_path, "--output_dir", str(out), *extra],
    )
    return main(*args)


def _state(path):
    from transformers import AutoModelForCausalLM

    return {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(path).state_dict().items()}


def test_sft_trains_on_masked_labels_and_params_change(tiny_model_path, tiny_tokenizer, tmp_path, capsys):
    trainer = _run(tiny_model_path, tmp_path / "run", "--max_steps", "2", "--save_strategy", "no")
    assert trainer.state.global_step == 2
    out = capsys.readouterr()  # `appo train`'s one line per step (here, not a terminal: no bar), no metric dicts
    assert "step 1/2 | loss " in out.out and "step 2/2 | loss " in out.out and "{'loss'" not in out.out + out.err
    assert "[SFT] 2/2 steps" in out.out and "it/s]" not in out.err
    row = trainer.train_dataset[0]
    trained = [i for i, lab in zip(row["input_ids"], row["labels"]) if lab != -100]
    assert all(lab in (-100, i) for i, lab in zip(row["input_ids"], row["labels"]))
    text = tiny_tokenizer.decode(trained)
    first = json.loads((REPO_ROOT / "recipes/tiny/data/sft_tir.jsonl").read_text().splitlines()[0])
    gpt = first["conversations"][1]["value"]
    start, end = gpt.index("<result>"), gpt.index("</result>") + len("</result>")
    assert text == gpt[:start] + gpt[end:] + "<|im_end|>"  # row 0 is the first trace (no shuffling)
    before, after = _state(tiny_model_path), _state(tmp_path / "run")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_sft_lora_and_packing(tiny_model_path, tmp_path):
    trainer = _run(
        tiny_model_path,
        tmp_path / "lora",
        "--max_steps",
        "2",
        "--save_strategy",
        "no",
        "--use_peft",
        "true",
        "--lora_r",
        "4",
        "--lora_target_modules",
        "all-linear",
        "--packing",
        "true",
        "--max_length",
        "512",
    )
    assert type(trainer.model).__name__.startswith("Peft")
    assert (tmp_path / "lora" / "adapter_model.safetensors").is_file()
    row = trainer.train_dataset[0]
    assert len(row["input_ids"]) <= 512 and len(row["seq_lengths"]) > 1  # several conversations per packed row
    ids, labels = row["input_ids"], row["labels"]
    result_open = trainer.processing_class.convert_tokens_to_ids("<result>")
    result_close = trainer.processing_class.convert_tokens_to_ids("</result>")
    assert result_open in ids and result_close in ids
    assert all(lab == -100 for i, lab in zip(ids, labels) if i in (result_open, result_close))
    assert any(lab != -100 for lab in labels)


def test_a_row_that_max_length_would_truncate_is_refused_before_the_model_loads(tiny_model_path, tmp_path, capsys):
    """TRL truncates silently, and a truncated tool trace loses its answer (the n = 16 study's cold start lost
    every 3-5 call chain trace this way at max_length 256)."""
    from appo_trl.cli import main

    argv = ["sft", "--config", RECIPE, "--model_name_or_path", tiny_model_path, "--output_dir", str(tmp_path / "o"),
            "--max_length", "40", "--max_steps", "1"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "SFT rows are longer than max_length=40 tokens" in err, err
    assert not (tmp_path / "o").exists()  # nothing trained


def test_row_length_check_allows_what_loses_nothing(tiny_tokenizer):
    from types import SimpleNamespace

    from datasets import Dataset

    from appo_trl.configs.errors import DataError
    from appo_trl.stages.sft import check_row_lengths

    rows = Dataset.from_list([{"input_ids": [1] * 10}, {"input_ids": [1] * 30}, {"input_ids": [1] * 31}])
    base = {"max_length": 30, "packing": False, "packing_strategy": "bfd", "truncate_long_rows": False}
    with pytest.raises(DataError, match=r"^1 of 3 SFT rows .* max_length=30 tokens \(the longest has 31\)"):
        check_row_lengths(rows, SimpleNamespace(**base))
    with pytest.raises(DataError):  # bfd packing truncates the overflow too
        check_row_lengths(rows, SimpleNamespace(**{**base, "packing": True}))
    for ok in (
        {"max_length": 31},
        {"max_length": None},
        {"truncate_long_rows": True},
        {"packing": True, "packing_strategy": "bfd_split"},
        {"packing": True, "packing_strategy": "wrapped"},
    ):
        check_row_lengths(rows, SimpleNamespace(**{**base, **ok}))


def test_appo_sft_cli_rejects_unknown_key(capsys):
    from appo_trl.cli import main

    assert main(["sft", "--config", RECIPE, "--mask_tool_result", "false"]) == 2
    assert "did you mean: mask_tool_results" in capsys.readouterr().err


def test_template_without_markers_gets_trls_training_template(tiny_model_path):
    # Real Qwen2.5 tokenizers ship a template without {% generation %}: TRL's training variant is swapped in.
    import importlib.resources
    from types import SimpleNamespace

    from datasets import Dataset
    from transformers import AutoTokenizer

    from appo_trl.stages.sft import tokenize_sft_dataset

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.chat_template = (importlib.resources.files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()
    args = SimpleNamespace(
        assistant_only_loss=True,
        mask_tool_results=True,
        tool_result_open="<result>",
        tool_result_close="</result>",
        dataset_num_proc=None,
    )
    row = tokenize_sft_dataset(Dataset.from_dict({"messages": [MESSAGES]}), tok, args)[0]
    trained = tok.decode([i for i, m in zip(row["input_ids"], row["assistant_masks"]) if m])
    assert trained == "\n<think>a</think><python>x</python><answer>7</answer><|im_end|>\n"  # TRL's markers


def test_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="appo tiny-model"):
        _run(str(tmp_path / "no-model"), tmp_path / "out")
