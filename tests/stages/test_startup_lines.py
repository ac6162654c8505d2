"""`appo train`'s start-up lines (issue 49): the weight-sync route in one line, one line saying that a run on the
random tiny model checks the plumbing only, and nothing on a CPU that only an accelerator needs (pin_memory, bars)."""

from __future__ import annotations

import logging
import warnings
from types import SimpleNamespace

import pytest

from appo_trl.stages.train import weight_sync_line
from appo_trl.tiny import RANDOM_WEIGHTS_MARKER, random_weights_note


def test_the_random_tiny_model_says_so_and_a_trained_copy_does_not(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    note = random_weights_note(tiny_model_path)
    assert note.startswith(f"{tiny_model_path} has random weights (appo tiny-model): this run checks the plumbing")
    assert "will not learn" in note and "\n" not in note
    # it points at the one command that makes a checkpoint the feature recipes learn from, and at a recipe of them
    assert "`make cold-start` (`appo demo --sft_only`)" in note and "recipes/demo/lora.yaml" in note
    AutoModelForCausalLM.from_pretrained(tiny_model_path).save_pretrained(tmp_path / "trained")  # e.g. after SFT
    assert random_weights_note(str(tmp_path / "trained")) is None
    assert random_weights_note("Qwen/Qwen3-0.6B") is None and random_weights_note(None) is None
    assert (tmp_path / "trained" / RANDOM_WEIGHTS_MARKER).exists() is False


def _args(**kw):
    return SimpleNamespace(**{"use_vllm": True, "vllm_mode": "server", "max_staleness": 0, **kw})


@pytest.mark.parametrize(
    ("args", "route", "urls", "peft", "line"),
    [
        (_args(use_vllm=False), None, 0, False, "weight sync: in-process (no vLLM; the policy samples itself, nothing to sync)"),
        (_args(use_vllm=False, max_staleness=1), None, 0, True,
         "weight sync: in-process (no vLLM; a copy of the policy samples ahead, updated every weight_sync_steps)"),
        (_args(vllm_mode="colocate"), None, 0, True, "weight sync: colocated vLLM engine, merged LoRA weights in process (TRL's)"),
        (_args(), "adapter", 1, True, "weight sync: adapter (only the LoRA adapter, loaded on 1 vLLM server each round)"),
        (_args(), "disk", 2, True, "weight sync: disk (merged LoRA weights as safetensors, reload_weights on 2 vLLM servers each round)"),
        (_args(), "disk", 1, False, "weight sync: disk (full weights as safetensors, reload_weights on 1 vLLM server each round)"),
        (_args(), "nccl", 4, False, "weight sync: NCCL (full weights broadcast to 4 vLLM servers each round)"),
        (_args(), "nccl", 1, True, "weight sync: NCCL (merged LoRA weights broadcast to 1 vLLM server each round)"),
    ],
)  # fmt: skip
def test_one_line_names_the_weight_sync_route(args, route, urls, peft, line):
    spec = SimpleNamespace(weight_sync=route, urls=[f"http://h:{8000 + i}" for i in range(urls)]) if urls else None
    assert weight_sync_line(args, spec, peft) == line


def test_the_train_stage_logs_the_route_and_the_random_weights_line(tiny_model_path, tmp_path, caplog):
    from appo_trl.configs.recipes import REPO_ROOT, parse_recipe
    from appo_trl.stages.train import dataclass_types, main

    argv = ["--config", str(REPO_ROOT / "recipes" / "tiny" / "grpo.yaml"), "--model_name_or_path", tiny_model_path,
            "--output_dir", str(tmp_path / "run"), "--max_steps", "1", "--max_completion_length", "8",
            "--save_strategy", "no"]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="appo_trl.stages.train"):
        main(*parse_recipe(dataclass_types(), argv))
    said = [r.getMessage() for r in caplog.records if r.name == "appo_trl.stages.train"]
    assert [s for s in said if s.startswith("weight sync: ")] == [
        "weight sync: in-process (no vLLM; the policy samples itself, nothing to sync)"
    ]
    assert sum("has random weights" in s for s in said) == 1


def test_no_pin_memory_on_a_machine_without_an_accelerator(tmp_path, monkeypatch):
    import torch

    from appo_trl.config import APPOConfig

    if torch.cuda.is_available():
        pytest.skip("the point is a machine without an accelerator")
    assert APPOConfig(output_dir=str(tmp_path)).dataloader_pin_memory is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "'pin_memory' argument is set as true but no accelerator is found"
        loader = torch.utils.data.DataLoader(
            [1, 2], pin_memory=APPOConfig(output_dir=str(tmp_path)).dataloader_pin_memory
        )
        assert list(loader) == [torch.tensor([1]), torch.tensor([2])]
    monkeypatch.setattr("appo_trl.config.checks._has_accelerator", lambda: True)  # TRL's default kept
    assert APPOConfig(output_dir=str(tmp_path), bf16=False).dataloader_pin_memory is True


def test_a_log_file_gets_no_library_progress_bars(monkeypatch):
    import datasets
    import transformers

    from appo_trl.stages import logs

    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    try:
        logs.setup_logging()
        assert not transformers.utils.logging.is_progress_bar_enabled()
        assert not datasets.is_progress_bar_enabled()
    finally:
        transformers.utils.logging.enable_progress_bar()
        datasets.enable_progress_bars()
