"""Tiny strategy recipes parse into the config they promise; an APPO run resumes from its checkpoint."""

from __future__ import annotations

import pytest
import torch

from appo_trl.configs.recipes import REPO_ROOT, parse_recipe
from appo_trl.stages.train import dataclass_types
from tests.trainer.fakes import ScriptedEngine
from tests.trainer.test_trainer import RewardSpy, make_trainer


@pytest.mark.parametrize(
    "name,expect",
    [
        ("arpo", dict(rollout_strategy="arpo", initial_rollouts=2, loss_mode="clip", arpo_entropy_timing="lookahead")),
        (
            "aepo",
            dict(
                rollout_strategy="aepo",
                dynamic_rollouts=True,
                loss_mode="entropy_balanced",
                entropy_balanced_advantage=True,
            ),
        ),
        ("appo", dict(rollout_strategy="appo", initial_rollouts=2, loss_mode="future_kl", drops_branch_rows=True)),
    ],
)
def test_tiny_recipes_parse(name, expect, tmp_path):
    _, cfg, _ = parse_recipe(
        dataclass_types(),
        ["--config", str(REPO_ROOT / "recipes" / "tiny" / f"{name}.yaml"), "--output_dir", str(tmp_path)],
    )
    assert cfg.tools == ["python"]
    assert {k: getattr(cfg, k) for k in expect} == expect


def test_appo_checkpoint_resume_continues(tmp_path, tiny_tokenizer, tiny_model_path, monkeypatch):
    kw = dict(
        tools=["python"],
        rollout_strategy="appo",
        initial_rollouts=2,
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=64,
        min_remaining_tokens=4,
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
    )
    first_engine = ScriptedEngine(tiny_tokenizer, filler=8)
    first = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, first_engine, RewardSpy(), **kw)
    first.train()
    final = {k: v.detach().clone() for k, v in first.model.named_parameters()}
    engine = ScriptedEngine(tiny_tokenizer, filler=8)
    resumed = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, engine, RewardSpy(), **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert resumed.state.global_step == 2
    assert engine.rollout_calls == [(1, 2)]  # only the second step's round was generated again
    # same scripted data and seeds: the resumed run lands on the uninterrupted run's parameters
    for k, v in resumed.model.named_parameters():
        assert torch.allclose(v, final[k], atol=1e-5), k
