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
