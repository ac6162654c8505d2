"""One real training step of each `reference:` preset (tiny model, scripted engine): the released code's switches
run end to end through `APPOTrainer` (loss step, branch selection, advantages), not only in the unit tests."""

from __future__ import annotations

import math

import pytest
import torch

from tests.trainer.fakes import ScriptedEngine
from tests.trainer.test_trainer import CPU, RewardSpy, make_trainer, spy_loss

REF_CPU = {k: v for k, v in CPU.items() if k != "loss_type"}  # the preset sets loss_type: bnpo


@pytest.mark.parametrize("algo", ["arpo", "aepo", "appo", "tree_grpo"])
def test_reference_preset_trains_one_step(algo, tmp_path, tiny_tokenizer, tiny_model_path):
    engine, reward = ScriptedEngine(tiny_tokenizer), RewardSpy()
    kw = dict(initial_rollouts=2, num_generations=4, per_device_train_batch_size=4, max_steps=1)
    trainer = make_trainer(
        tmp_path,
        tiny_tokenizer,
        tiny_model_path,
        engine,
        reward,
        **{**REF_CPU, "beta": 0.001},
        tools=["python"],
        reference=algo,
        max_completion_length=64,
        **kw,
    )
    args = trainer.args
    assert args.loss_type == "bnpo" and args.kl_clamp == 10.0 and not args.vllm_importance_sampling_correction
    assert trainer._custom_loss
    seen = spy_loss(trainer)
    trainer.train()
    assert seen and all(torch.isfinite(s["advantages"]).all() for s in seen)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and math.isfinite(logs[-1]["loss"])
    if algo == "appo":
        assert len(engine.branch_requests) == 2  # one prompt, n − N = 2 branch points, released selection rules
        assert seen[0]["completion_ids"].size(0) == 2  # branch rows dropped: the 2 initial rows remain
