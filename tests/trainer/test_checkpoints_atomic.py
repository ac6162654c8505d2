"""Interrupted checkpoint saves never break a later resume (issue 21).

The broken folders are the three kinds measured after SIGKILL / Ctrl-C / SIGTERM / a full disk mid-save with
transformers' in-place save: an empty `checkpoint-N/`, a 0-byte `optimizer.pt` without `trainer_state.json`, a
`trainer_state.json` cut at 16,384 bytes. Saves run through the SFT stage's trainer (`sft_trainer_class()`,
TRL's `SFTTrainer` + `AtomicCheckpointMixin`, the same mixin as `APPOTrainer`) on the tiny model.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from appo_trl.trainer.checkpoints import (
    CheckpointError,
    CheckpointSaveError,
    checkpoint_problem,
    resolve_resume_checkpoint,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _folders(out):
    return sorted(n for n in os.listdir(out) if "checkpoint" in n)


def _complete(folder, step):
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    (folder / "optimizer.pt").write_bytes(b"x" * 64)
    return folder


def test_resume_skips_each_kind_of_broken_checkpoint(tmp_path, caplog):
    _complete(tmp_path / "checkpoint-2", 2)
    (tmp_path / "checkpoint-4").mkdir()  # SIGKILL right after mkdir
    (tmp_path / "checkpoint-6").mkdir()
    (tmp_path / "checkpoint-6" / "optimizer.pt").write_bytes(b"")  # killed inside torch.save
    broken = _complete(tmp_path / "checkpoint-8", 8)
    text = json.dumps({"global_step": 8, "log_history": [{"loss": 0.5, "step": i} for i in range(2000)]})
    (broken / "trainer_state.json").write_text(text[:16384])  # cut mid-write
    weights = _complete(tmp_path / "checkpoint-9", 9)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (weights / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)  # 8 of 16
    (tmp_path / "_tmp-checkpoint-10" / "checkpoint-10").mkdir(parents=True)  # an atomic save that was killed
    with caplog.at_level(logging.WARNING, logger="appo_trl.trainer.checkpoints"):
        assert resolve_resume_checkpoint(True, str(tmp_path)) == str(tmp_path / "checkpoint-2")
    log = caplog.text
    assert f"skipping {tmp_path / 'checkpoint-4'}, an incomplete checkpoint (empty folder)" in log
    assert (
        f"skipping {tmp_path / 'checkpoint-6'}, an incomplete checkpoint (no trainer_state.json (0-byte optimizer.pt))"
        in log
    )
    assert (
        f"skipping {tmp_path / 'checkpoint-8'}" in log
        and "trainer_state.json is truncated or not JSON (16384 bytes" in log
    )
    assert f"skipping {tmp_path / 'checkpoint-9'}" in log and "model.safetensors is truncated (" in log
    assert f"ignoring {tmp_path / '_tmp-checkpoint-10'}, an interrupted save" in log
    # an explicit path to a broken checkpoint is one clear error naming the problem and the good one
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint \(empty folder\).*checkpoint-2"):
        resolve_resume_checkpoint(str(tmp_path / "checkpoint-4"), str(tmp_path))
    assert checkpoint_problem(str(tmp_path / "checkpoint-2")) is None


def _sft_trainer(model_path, out, max_steps, save_steps=1, **kw):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig

    from appo_trl.stages.sft import sft_trainer_class

    args = SFTConfig(
        output_dir=str(out), max_steps=max_steps, save_steps=save_steps, per_device_train_batch_size=2,
        learning_rate=1e-3, use_cpu=True, report_to="none", logging_steps=1, disable_tqdm=True, seed=0, **kw,
    )  # fmt: skip
    rows = Dataset.from_dict({"input_ids": [[5 + (i * 7 + j) % 50 for j in range(12)] for i in range(16)]})
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return sft_trainer_class()(model=model_path, args=args, train_dataset=rows, processing_class=tokenizer)


def _fail_optimizer_save_at(monkeypatch, step_folder: str, exc: BaseException):
    real = torch.save

    def save(obj, f, *a, **k):
        if isinstance(f, str) and f.endswith(os.path.join(step_folder, "optimizer.pt")):
            with open(f, "wb") as fh:
                fh.write(b"partial")  # some bytes reached the disk
            raise exc
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)


@pytest.mark.parametrize(
    "exc,full",
    [
        (KeyboardInterrupt(), False),  # Ctrl-C (and SIGTERM, handled as Ctrl-C) mid-save
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 1763584 vs 1763472"), True),
    ],
    ids=["ctrl-c", "enospc", "torch-unexpected-pos"],
)
def test_failed_save_leaves_earlier_checkpoints_and_says_why(tiny_model_path, tmp_path, monkeypatch, exc, full):
    import shutil

    out = tmp_path / "out"
    trainer = _sft_trainer(tiny_model_path, out, max_steps=3)
    _fail_optimizer_save_at(monkeypatch, "checkpoint-2", exc)
    if full:  # torch's own message says nothing of the disk: the free space does
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=4096))
    with pytest.raises(CheckpointSaveError if full else KeyboardInterrupt) as info:
        trainer.train()
    if full:
        message = str(info.value)
        assert "No space left on device" in message and str(out / "checkpoint-2") in message
        assert f"earlier checkpoints are intact (newest: {out / 'checkpoint-1'})" in message
        assert message.endswith("resume with --resume_from_checkpoint true") and info.value.errno == errno.ENOSPC
    assert _folders(out) == ["checkpoint-1"]  # no checkpoint-2, no staging folder left
    assert checkpoint_problem(str(out / "checkpoint-1")) is None
    monkeypatch.undo()
    resumed = _sft_trainer(tiny_model_path, out, max_steps=3)
    resumed.train(resume_from_checkpoint=resolve_resume_checkpoint(True, str(out)))
    assert resumed.state.global_step == 3
    assert _folders(out) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_other_save_errors_are_not_called_a_full_disk(tiny_model_path, tmp_path, monkeypatch):
    out = tmp_path / "out"
    trainer = _sft_trainer(tiny_model_path, out, max_steps=2)
    _fail_optimizer_save_at(monkeypatch, "checkpoint-2", RuntimeError("pickling failed"))
    with pytest.raises(RuntimeError, match="^pickling failed$"):
        trainer.train()
    assert _folders(out) == ["checkpoint-1"]


KILLED_RUN = textwrap.dedent(
    """
    import os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    from tests.trainer.test_checkpoints_atomic import _sft_trainer
    real = torch.save
    def save(obj, f, *a, **k):
        if isinstance(f, str) and f.endswith(os.path.join("checkpoint-2", "optimizer.pt")):
            with open(f, "wb") as fh:
                fh.write(b"partial")
            os.kill(os.getpid(), signal.SIGKILL)
        return real(obj, f, *a, **k)
    torch.save = save
    _sft_trainer({model!r}, {out!r}, max_steps=3).train()
    """
)


def test_sigkill_mid_save_then_resume(tiny_model_path, tmp_path, caplog):
    """A process SIGKILLed inside a save (no cleanup runs) leaves only its staging folder; the resume skips it,
    continues from the last complete checkpoint, and the next save removes the leftover."""
    out = tmp_path / "out"
    code = KILLED_RUN.format(tests=REPO, model=tiny_model_path, out=str(out))
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert _folders(out) == ["_tmp-checkpoint-2", "checkpoint-1"]  # never a half-written checkpoint-2
    with caplog.at_level(logging.WARNING, logger="appo_trl.trainer.checkpoints"):
        checkpoint = resolve_resume_checkpoint(True, str(out))
    assert checkpoint == str(out / "checkpoint-1") and "_tmp-checkpoint-2, an interrupted save" in caplog.text
    resumed = _sft_trainer(tiny_model_path, out, max_steps=3)
    resumed.train(resume_from_checkpoint=True)  # the trainer's own `True` also takes the newest complete one
    assert resumed.state.global_step == 3
    assert _folders(out) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3]


def test_save_replaces_a_broken_folder_and_keeps_rotation(tiny_model_path, tmp_path):
    """A broken `checkpoint-2` of an earlier run is replaced by the new save; `save_total_limit` still rotates."""
    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "optimizer.pt").write_bytes(b"")
    _sft_trainer(tiny_model_path, out, max_steps=3, save_total_limit=2).train()
    assert _folders(out) == ["checkpoint-2", "checkpoint-3"]
    assert checkpoint_problem(str(out / "checkpoint-2")) is None


def test_multi_process_cpu_resume_loads_the_optimizer(tiny_model_path, tmp_path, monkeypatch):
    """On a 2-process CPU run `args.device` is `cpu:0`; transformers maps the optimizer state there and torch
    cannot restore to it ("don't know how to restore data location ... (tagged with cpu:0)"): every such resume
    crashed. Reproduced in one process by giving the arguments that device and world size."""
    from trl import SFTConfig

    out = tmp_path / "out"
    _sft_trainer(tiny_model_path, out, max_steps=1).train()
    trainer = _sft_trainer(tiny_model_path, out, max_steps=1)
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    monkeypatch.setattr(SFTConfig, "world_size", property(lambda self: 2))
    trainer.args.__dict__["_setup_devices"] = torch.device("cpu", 0)
    assert str(trainer.args.device) == "cpu:0"
    trainer._load_optimizer_and_scheduler(str(out / "checkpoint-1"))
    saved = torch.load(out / "checkpoint-1" / "optimizer.pt", weights_only=True)["state"]
    loaded = trainer.optimizer.state_dict()["state"]
    assert loaded.keys() == saved.keys() and loaded
    torch.testing.assert_close(loaded[0]["exp_avg"], saved[0]["exp_avg"])


def test_a_full_disk_at_the_first_checkpoint_names_no_earlier_one(tiny_model_path, tmp_path, monkeypatch):
    """Before: "the earlier checkpoints are intact ... resume with --resume_from_checkpoint true" with none saved."""
    out = tmp_path / "out"
    trainer = _sft_trainer(tiny_model_path, out, max_steps=2)
    _fail_optimizer_save_at(monkeypatch, "checkpoint-1", OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(CheckpointSaveError) as info:
        trainer.train()
    message = str(info.value)
    assert "no checkpoint was saved yet" in message and "intact" not in message
    assert message.endswith("Free some space, then run again (there is no checkpoint to resume)")
    assert _folders(out) == []
