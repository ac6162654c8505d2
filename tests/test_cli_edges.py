"""`appo train` refuses, in one line before the model loads, what issue 48 found to fail after it: LoRA options
(causes 4, 12) and a checkpoint of another kind (cause 13). The model folder of `workdir` cannot be loaded (its
config.json is `{}`), so a line from these checks proves they ran before the model."""

from __future__ import annotations

import pytest

from tests.test_cli_errors import appo, one_error_line, recipe, workdir  # noqa: F401 - the fixture


def test_a_full_checkpoint_resumed_into_a_lora_run_is_one_line(workdir, capfd):  # noqa: F811
    import torch
    from safetensors.torch import save_file

    checkpoint = workdir / "out" / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, str(checkpoint / "model.safetensors"))
    assert appo(["train", "--config", recipe(workdir, use_peft=True, resume_from_checkpoint=str(checkpoint))]) == 2
    line = one_error_line(capfd)
    assert "holds full model weights and no LoRA adapter, but this run trains one (use_peft is true)" in line, line


@pytest.mark.parametrize("keys, expected", [
    ({"lora_r": 0}, "lora_r=0: the LoRA rank must be a whole number >= 1."),
    ({"lora_dropout": 1.5}, "lora_dropout=1.5 must be in [0, 1)"),
])  # fmt: skip
def test_bad_lora_options_are_one_line_before_the_model_loads(workdir, capfd, keys, expected):  # noqa: F811
    assert appo(["train", "--config", recipe(workdir, use_peft=True, **keys)]) == 2
    assert expected in one_error_line(capfd)
