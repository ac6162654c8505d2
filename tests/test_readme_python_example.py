"""The README's Python API example runs as written on a CPU (issue 34, item 3).

The first ```python block of README.md is run with three changes, nothing else: the model is the tiny offline
model with TRL's Qwen3 template (for "Qwen/Qwen3-0.6B"), and the config gains `max_steps=1,
max_completion_length=16` (to stay fast). No `use_cpu`: an unset `bf16` follows the hardware.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def qwen3_tiny(tmp_path_factory):
    from appo_trl.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-readme"), chat_template="qwen3")


def test_readme_python_example_runs_on_cpu(qwen3_tiny, tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the point is a machine without an accelerator")
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert 'model="Qwen/Qwen3-0.6B"' in code and "num_generations=8)" in code and "use_cpu" not in code
    code = code.replace('model="Qwen/Qwen3-0.6B"', f"model={qwen3_tiny!r}")
    code = code.replace("num_generations=8)", "num_generations=8, max_steps=1, max_completion_length=16)")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own example
    assert scope["trainer"].state.global_step == 1 and scope["args"].bf16 is False
