"""A LoRA run's checkpoints, final model and Hub push hold the adapter; a resume restores adapter and optimizer.

In-process APPO on the tiny model with a reward that varies with the completion length (real updates). A run
killed after its step-2 checkpoint and resumed ends with the uninterrupted run's adapter: the adapter weights and
AdamW's moments came back (without `optimizer.pt` the resumed adapter differs)."""

from __future__ import annotations

import os
import shutil

import torch
import yaml
from peft import LoraConfig

from appo_trl.config import APPOConfig
from appo_trl.trainer.trainer import APPOTrainer
from tests.trainer.test_checkpoints_resume_sampling import CompletionLog, StopAt
from tests.trainer.test_trainer import CPU, dataset

ADAPTER_FILES = {"adapter_model.safetensors", "adapter_config.json"}


def _trainer(out, model_path, tokenizer, log, callbacks=()):
    args = APPOConfig(
        output_dir=str(out), **{**CPU, "save_strategy": "steps", "learning_rate": 5e-2}, save_steps=2, max_steps=4,
        rollout_strategy="appo", initial_rollouts=2, num_generations=4, per_device_train_batch_size=4,
        max_completion_length=12, min_remaining_tokens=2, temperature=1.0,
    )  # fmt: skip
    trainer = APPOTrainer(model=model_path, reward_funcs=[log], args=args, train_dataset=dataset(),
                          processing_class=tokenizer, callbacks=list(callbacks),
                          peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))  # fmt: skip
    log.trainer = trainer
    return trainer


def adapter(trainer) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(trainer.model).items()}


def resume(tmp_path, tiny_model_path, tiny_tokenizer, run: str):
    torch.manual_seed(1234)  # a new process: nothing of the first run's in-memory state survives
    log = CompletionLog()
    trainer = _trainer(tmp_path / run, tiny_model_path, tiny_tokenizer, log)
    trainer.train(resume_from_checkpoint=str(tmp_path / run / "checkpoint-2"))
    return trainer, log


def test_checkpoints_hold_the_adapter_and_resume_restores_adapter_and_optimizer(
    tmp_path, tiny_model_path, tiny_tokenizer
):
    full_log = CompletionLog()
    full = _trainer(tmp_path / "full", tiny_model_path, tiny_tokenizer, full_log)
    start = adapter(full)
    full.train()
    final = adapter(full)
    assert not all(torch.equal(start[k], final[k]) for k in final)  # the adapter learned

    _trainer(tmp_path / "run", tiny_model_path, tiny_tokenizer, CompletionLog(), [StopAt(2)]).train()
    ckpt = tmp_path / "run" / "checkpoint-2"
    files = set(os.listdir(ckpt))
    assert ADAPTER_FILES | {"optimizer.pt"} <= files and "model.safetensors" not in files  # the adapter only
    config = yaml.safe_load((ckpt / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == tiny_model_path and config["r"] == 8
    shutil.copytree(tmp_path / "run", tmp_path / "no-optimizer")
    os.remove(tmp_path / "no-optimizer" / "checkpoint-2" / "optimizer.pt")

    trainer, log = resume(tmp_path, tiny_model_path, tiny_tokenizer, "run")
    assert trainer.state.global_step == 4 and [log.by_step[s] for s in (3, 4)] == [full_log.by_step[s] for s in (3, 4)]
    resumed = adapter(trainer)
    assert all(torch.allclose(resumed[k], final[k], atol=1e-6) for k in final)
    assert not any("lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad is False)

    # the same resume without AdamW's saved moments ends elsewhere: the check above needs the optimizer back
    trainer, _ = resume(tmp_path, tiny_model_path, tiny_tokenizer, "no-optimizer")
    other = adapter(trainer)
    assert max((other[k] - final[k]).abs().max().item() for k in final) > 1e-4
