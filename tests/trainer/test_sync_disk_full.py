"""A full disk at the vLLM weight sync's save (issue 48, cause 14, and the full-weight disk route): one line
(`SyncDiskFullError`, a `WeightSyncError`, so `appo train` ends in one line), and no unfinished file left behind."""

from __future__ import annotations

import os

import pytest
from safetensors import SafetensorError

from appo_trl.vllm.client import SyncDiskFullError
from tests.trainer.test_lora_sync import fake_vllm, lora_trainer, varied_policy

FULL = "Error while serializing: I/O error: No space left on device (os error 28)"  # safetensors' own wording


def _writes_then_fails(tensors, path, *args, **kwargs):
    with open(path, "wb") as fh:  # a partial file, as a write cut short leaves it
        fh.write(b"\0" * 1024)
    raise SafetensorError(FULL)


@pytest.mark.parametrize("route", ["adapter", "full"])
def test_a_full_disk_at_the_sync_is_one_line_and_leaves_nothing(route, tmp_path, tiny_tokenizer, tiny_model_path,
                                                                monkeypatch):  # fmt: skip
    import safetensors.torch

    sync_dir = tmp_path / "sync"
    with fake_vllm.FakeVLLMServer(varied_policy(tiny_tokenizer), tiny_tokenizer, max_lora_rank=8) as server:
        if route == "adapter":
            trainer = lora_trainer(tmp_path, tiny_tokenizer, tiny_model_path, server, vllm_weight_sync_dir=str(sync_dir))
            assert trainer.vllm_server.weight_sync == "adapter"
            monkeypatch.setattr("peft.peft_model.safe_save_file", _writes_then_fails)
        else:
            from appo_trl.config import APPOConfig
            from appo_trl.trainer.trainer import APPOTrainer
            from tests.trainer.test_trainer import CPU, RewardSpy, dataset

            args = APPOConfig(output_dir=str(tmp_path / "out"), **{**CPU, **dict(
                use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url, num_generations=4,
                per_device_train_batch_size=4, max_steps=2, max_completion_length=16, vllm_weight_sync="disk",
                vllm_weight_sync_dir=str(sync_dir), vllm_importance_sampling_correction=False)})  # fmt: skip
            trainer = APPOTrainer(model=tiny_model_path, reward_funcs=[RewardSpy()], args=args,
                                  train_dataset=dataset(), processing_class=tiny_tokenizer)  # fmt: skip
            monkeypatch.setattr(safetensors.torch, "save_file", _writes_then_fails)
        with pytest.raises(SyncDiskFullError) as err:
            trainer.train()
    message = str(err.value)
    assert "\n" not in message and "No space left on device" in message and str(sync_dir) in message, message
    left = sorted(os.listdir(sync_dir)) if sync_dir.exists() else []
    assert not [n for n in left if n.endswith((".tmp", ".partial"))], left


def test_ctrl_c_during_the_adapter_save_leaves_no_staging_folder(tmp_path, tiny_tokenizer, tiny_model_path,
                                                                 monkeypatch):  # fmt: skip
    sync_dir = tmp_path / "sync"

    def interrupted(tensors, path, *args, **kwargs):
        with open(path, "wb") as fh:
            fh.write(b"\0" * 16)
        raise KeyboardInterrupt

    with fake_vllm.FakeVLLMServer(varied_policy(tiny_tokenizer), tiny_tokenizer, max_lora_rank=8) as server:
        trainer = lora_trainer(tmp_path, tiny_tokenizer, tiny_model_path, server, vllm_weight_sync_dir=str(sync_dir))
        monkeypatch.setattr("peft.peft_model.safe_save_file", interrupted)
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
    assert not [n for n in os.listdir(sync_dir) if n.endswith(".tmp")], os.listdir(sync_dir)
