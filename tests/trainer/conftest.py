"""Fixtures that several trainer test files share."""

from __future__ import annotations

import pytest


@pytest.fixture
def tok(tiny_chat_model_path):
    """The tiny tokenizer with TRL's Qwen2.5 template (TRL parses environment calls with its response schema,
    which it knows for the templates it ships); the environment tests' tokenizer."""
    from transformers import AutoTokenizer

    from tests.trainer.envs_helpers import QWEN

    tok = AutoTokenizer.from_pretrained(tiny_chat_model_path)
    tok.chat_template = QWEN
    return tok


@pytest.fixture
def cuda_dispatch_on_cpu(monkeypatch):
    """The CUDA kernel dispatch (`_cuda_attention`) on CPU: `_on_gpu` says yes, no varlen kernel in this process
    (FlexAttention serves), no kernel has failed yet and no log line has been said yet in this process."""
    import appo_trl.tree.attention as ta

    monkeypatch.setattr(ta, "_on_gpu", lambda query: True)
    monkeypatch.setattr(ta, "_torch_varlen", lambda: None)
    monkeypatch.setattr(ta, "_flash_varlen", lambda: None)
    monkeypatch.setattr(ta, "_FAILED", set())
    ta._say_fallback.cache_clear()
    yield
    ta._say_fallback.cache_clear()
