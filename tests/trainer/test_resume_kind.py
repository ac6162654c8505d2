"""Resuming a checkpoint of another kind is one line naming what does not match (issue 48, cause 13)."""

from __future__ import annotations

import json

import pytest
from peft import LoraConfig

from appo_trl.trainer.resume_kind import ResumeKindError, check_resume_kind, resume_kind_problem

LORA = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _folder(tmp_path, adapter=None, full=False):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "trainer_state.json").write_text("{}")
    if adapter is not None:
        (tmp_path / "adapter_config.json").write_text(json.dumps(adapter))
    if full:
        (tmp_path / "model.safetensors").write_bytes(b"x")
    return str(tmp_path)


SAVED = {"r": 8, "target_modules": ["v_proj", "q_proj"], "use_dora": False, "modules_to_save": None}


def test_each_mismatch_is_named(tmp_path):
    lora, full = _folder(tmp_path / "lora", SAVED), _folder(tmp_path / "full", full=True)
    assert resume_kind_problem(lora, LORA) is None and resume_kind_problem(full, None) is None
    assert resume_kind_problem(lora, None).endswith("holds a LoRA adapter (r=8), but this run trains the full model "
                                                    "(use_peft is false): set use_peft: true with the checkpoint's "
                                                    "LoRA options, or resume a full checkpoint")  # fmt: skip
    assert "holds full model weights and no LoRA adapter, but this run trains one" in resume_kind_problem(full, LORA)
    other = LoraConfig(r=4, target_modules=["q_proj", "k_proj"], modules_to_save=["lm_head"], task_type="CAUSAL_LM")
    assert resume_kind_problem(lora, other).endswith(
        "holds a LoRA adapter of another shape (lora_r 8 there, 4 here; lora_target_modules ['q_proj', 'v_proj'] "
        "there, ['k_proj', 'q_proj'] here; lora_modules_to_save [] there, ['lm_head'] here): resume with the same "
        "options")  # fmt: skip
    all_linear = LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM")  # resolved by peft: not compared
    assert resume_kind_problem(lora, all_linear) is None
    check_resume_kind(None, LORA)
    with pytest.raises(ResumeKindError):
        check_resume_kind(lora, None)


def _trainer(tmp_path, model_path, tokenizer, peft_config, **kw):
    from appo_trl.config import APPOConfig
    from appo_trl.trainer.trainer import APPOTrainer
    from tests.trainer.test_trainer import CPU, dataset

    args = APPOConfig(output_dir=str(tmp_path), **{**CPU, "save_strategy": "steps", "save_steps": 1, "max_steps": 1,
                                                   "num_generations": 4, "per_device_train_batch_size": 4,
                                                   "max_completion_length": 8, **kw})  # fmt: skip

    def length(completions, **kw):
        return [float(len(c[0]["content"])) for c in completions]

    return APPOTrainer(model=model_path, reward_funcs=[length], args=args, train_dataset=dataset(),
                       processing_class=tokenizer, peft_config=peft_config)  # fmt: skip


def test_resuming_a_lora_checkpoint_into_another_kind_is_one_line(tmp_path, tiny_model_path, tiny_tokenizer):
    _trainer(tmp_path, tiny_model_path, tiny_tokenizer, LORA).train()
    checkpoint = str(tmp_path / "checkpoint-1")
    for peft_config, expected in [
        (None, "holds a LoRA adapter (r=8), but this run trains the full model"),
        (LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
         "holds a LoRA adapter of another shape (lora_r 8 there, 4 here)"),
    ]:  # before: "Error(s) in loading state_dict" / "Can't find a checkpoint index" tracebacks
        trainer = _trainer(tmp_path, tiny_model_path, tiny_tokenizer, peft_config, max_steps=2)
        with pytest.raises(ResumeKindError) as err:
            trainer.train(resume_from_checkpoint=checkpoint)
        assert expected in str(err.value) and "\n" not in str(err.value)
