from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def qwen3_tiny(tmp_path_factory) -> str:
    """The tiny offline model with TRL's bundled Qwen3 template (`appo tiny-model --chat_template tools`)."""
    from appo_trl.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-examples"), chat_template="tools")
