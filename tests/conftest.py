"""Shared fixtures: offline environment, the tiny model (built once per session), skip rules."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

SHARED_DATA = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "arpo"))


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """Path of a tiny random Qwen3 model + tokenizer with tool tags (built once, offline)."""
    from appo_trl.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_sft_model_path(tiny_model_path, tmp_path_factory) -> str:
    """The tiny model after a short SFT cold start on the tiny tool traces (what `appo demo` does first).

    Unlike the random model, it writes `<think>`/`<python>`/`<answer>` blocks, so tool calls happen and
    rewards vary within a group (the random model scores -1 everywhere: zero advantages, no update).
    """
    from appo_trl.configs.recipes import REPO_ROOT, parse_recipe
    from appo_trl.stages import sft

    out = tmp_path_factory.mktemp("tiny-sft")
    args = parse_recipe(sft.dataclass_types(), [
        "--config", str(REPO_ROOT / "recipes" / "tiny" / "sft.yaml"), "--model_name_or_path", tiny_model_path,
        "--output_dir", str(out), "--max_steps", "120", "--learning_rate", "3e-3", "--save_strategy", "no",
        "--dataset_name", str(REPO_ROOT / "recipes" / "tiny" / "data" / "sft_tir.jsonl"), "--logging_steps", "60",
    ])  # fmt: skip
    sft.main(*args)
    return str(out)


@pytest.fixture(scope="session")
def tiny_chat_model_path(tmp_path_factory) -> str:
    """The tiny model with the Qwen-style function-calling chat template (`<tool_call>` JSON, `tool` role)."""
    from appo_trl.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-chat"), chat_template="tools")


@pytest.fixture(scope="session")
def tiny_chat_tokenizer(tiny_chat_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_chat_model_path)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def arpo_data_dir() -> str:
    """ARPO's own data files (format-compatibility tests only); skips when the shared folder is absent."""
    if not os.path.isdir(SHARED_DATA):
        pytest.skip(f"ARPO data not found at {SHARED_DATA}")
    return SHARED_DATA


def pytest_collection_modifyitems(config, items):
    import importlib.util

    has_cuda = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        has_cuda = torch.cuda.is_available()
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if item.get_closest_marker("gpu") is not None:  # the marker, not a test id such as bench/gpu.py
                item.add_marker(skip)
