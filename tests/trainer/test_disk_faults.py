"""Disks that fill and folders that refuse writes: one line, and never a model folder that looks complete.

As root, the tests mount a 600 KB tmpfs (the tiny model's weights do not fit) or a read-only one; elsewhere a
stand-in refuses the writes with the same errno.
"""

from __future__ import annotations

import errno
import os
import subprocess

import pytest

from appo_trl.trainer.checkpoints import CheckpointSaveError, save_final_model


@pytest.fixture
def small_disk(tmp_path):
    """A 600 KB tmpfs (None where this process cannot mount one); always unmounted."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(folder)], capture_output=True
        ).returncode
        == 0
    )
    try:
        yield folder if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], check=False)


def _trainer(out, tok, model_path):
    from datasets import Dataset

    from appo_trl.config import APPOConfig
    from appo_trl.trainer.trainer import APPOTrainer
    from tests.trainer.test_trainer import CPU

    data = Dataset.from_dict({"prompt": ["What is 1+1?"] * 4, "answer": ["2"] * 4})
    args = APPOConfig(output_dir=str(out), **CPU, num_generations=2, per_device_train_batch_size=2, max_steps=1)
    return APPOTrainer(model=model_path, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                       args=args, train_dataset=data, processing_class=tok)  # fmt: skip


def fail_saving(trainer, monkeypatch) -> None:
    """`trainer.save_model` writes the model, then fails as a full disk does."""
    real = trainer.save_model

    def save_model(folder):
        real(folder)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer, "save_model", save_model)


def test_full_disk_at_the_final_save_is_one_line_and_leaves_no_model_folder(
    small_disk, tmp_path, tiny_tokenizer, tiny_model_path, monkeypatch
):
    out = small_disk or tmp_path / "out"
    os.makedirs(out / "checkpoint-1", exist_ok=True)  # a complete earlier checkpoint (as checkpoint_problem reads it)
    (out / "checkpoint-1" / "trainer_state.json").write_text("{}")
    trainer = _trainer(out, tiny_tokenizer, tiny_model_path)
    if small_disk is None:  # stand-in: the weights file cannot be written
        fail_saving(trainer, monkeypatch)
    with pytest.raises(CheckpointSaveError) as err:
        save_final_model(trainer, str(out))
    msg = str(err.value)
    assert "\n" not in msg and "No space left on device" in msg and str(out / "checkpoint-1") in msg
    left = sorted(os.listdir(out))
    assert (
        "config.json" not in left and "model.safetensors" not in left and not any(n.startswith("_tmp") for n in left)
    )


def test_final_save_moves_a_complete_model_into_output_dir(tmp_path, tiny_tokenizer, tiny_model_path):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(tmp_path, tiny_tokenizer, tiny_model_path)
    save_final_model(trainer, str(tmp_path))
    assert not any(n.startswith("_tmp") for n in os.listdir(tmp_path))
    assert (tmp_path / "trainer_state.json").exists()
    AutoModelForCausalLM.from_pretrained(str(tmp_path))


def test_full_disk_at_the_final_save_without_a_checkpoint_does_not_say_resume(tmp_path, tiny_tokenizer,
                                                                              tiny_model_path, monkeypatch):  # fmt: skip
    trainer = _trainer(tmp_path, tiny_tokenizer, tiny_model_path)
    fail_saving(trainer, monkeypatch)
    with pytest.raises(CheckpointSaveError) as err:
        save_final_model(trainer, str(tmp_path))
    msg = str(err.value)
    assert "no checkpoint was saved, so the trained weights are lost" in msg and "--resume_from_checkpoint" not in msg
    assert msg.endswith("Free some space, then run again (there is no checkpoint to resume)")
