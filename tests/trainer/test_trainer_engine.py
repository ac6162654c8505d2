"""APPOTrainer on the real `appo_trl.rollout.RolloutEngine` with a scripted `Backend` and a scripted tool.

The backend answers every request deterministically: before a tool result it emits
`<python> print(2+2) </python>` (stop), after one it emits `<answer> 4 </answer><|im_end|>` (eos), each token
with logprob −0.5 and a two-entry top-k. So tool calls, results, masks and branches happen for real in the
engine, and the trainer computes real logps on those tokens.
"""

from __future__ import annotations

import pytest
import torch

from appo_trl.tools.base import ToolResult
from tests.trainer.test_trainer import RewardSpy, make_trainer, spy_loss

rollout = pytest.importorskip("appo_trl.rollout.engine")


class ScriptedBackend:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.result_id = tokenizer.convert_tokens_to_ids("<result>")
        self.calls = 0

    async def generate(self, prompt_ids, params):
        from appo_trl.rollout import Segment

        self.calls += 1
        if self.result_id in prompt_ids:
            ids = self.tok.encode(" <answer> 4 </answer>", add_special_tokens=False) + [self.tok.eos_token_id]
            reason, stop = "eos", None
        else:
            ids = self.tok.encode(
                "<think> the answer </think> <python> print(2+2) </python>", add_special_tokens=False
            )
            reason, stop = "stop", "</python>"
        ids = ids[: params.max_tokens]
        if len(ids) == params.max_tokens and reason == "eos":
            reason = "length"
        tops = [{i: -0.5, (i + 1) % len(self.tok): -1.0} for i in ids] if params.logprobs else None
        return Segment(ids, [-0.5] * len(ids), tops, reason, stop if reason == "stop" else None)


class ScriptedPython:
    name, tag = "python", "python"

    async def call(self, text):
        return ToolResult(text="4")

    async def aclose(self):
        pass


def real_engine(tokenizer, **cfg):
    from appo_trl.rollout import RolloutConfig, RolloutEngine

    config = RolloutConfig(max_completion_length=96, call_limit=3, tool_tags=["python"], **cfg)
    return RolloutEngine(ScriptedBackend(tokenizer), tokenizer, config, {"python": ScriptedPython()})


def _check_masks(tokenizer, seen):
    for inputs in seen:
        mask = inputs["completion_mask"] * inputs["tool_mask"]
        assert (
            int(inputs["num_items_in_batch"]) == int(sum((s["completion_mask"] * s["tool_mask"]).sum() for s in seen))
            or len(seen) == 1
        )
        for row in range(mask.size(0)):
            ids = inputs["completion_ids"][row]
            start = (ids == tokenizer.convert_tokens_to_ids("<result>")).nonzero()
            assert start.numel() > 0
            assert inputs["tool_mask"][row, start[0, 0]] == 0  # injected result tokens are masked


def test_grpo_through_the_real_engine(tmp_path, tiny_tokenizer, tiny_model_path):
    engine, reward = real_engine(tiny_tokenizer), RewardSpy()
    trainer = make_trainer(
        tmp_path,
        tiny_tokenizer,
        tiny_model_path,
        engine,
        reward,
        tools=["python"],
        num_generations=4,
        per_device_train_batch_size=4,
        max_steps=1,
        max_completion_length=96,
    )
    seen = spy_loss(trainer)
    trainer.train()
    assert len(reward.calls[0]["texts"]) == 4 and reward.calls[0]["num_tool_calls"] == [1, 1, 1, 1]
    assert all("<answer> 4 </answer>" in t for t in reward.calls[0]["texts"])
    _check_masks(tiny_tokenizer, seen)
    engine.close()


@pytest.mark.parametrize("strategy", ["arpo", "aepo"])
def test_arpo_aepo_branch_in_the_loop_and_refill_to_n(
    tmp_path, tiny_tokenizer, tiny_model_path, monkeypatch, strategy
):
    engine, reward = (
        real_engine(tiny_tokenizer, hook_mode="lookahead", record_entropies=True, entropy_topk=2),
        RewardSpy(),
    )
    extra = dict(dynamic_rollouts=True, dynamic_rollouts_source="reuse") if strategy == "aepo" else {}
    trainer = make_trainer(
        tmp_path,
        tiny_tokenizer,
        tiny_model_path,
        engine,
        reward,
        tools=["python"],
        rollout_strategy=strategy,
        initial_rollouts=2,
        num_generations=4,
        # P = 1: ARPO clip(τ + βΔH) with τ = 1; AEPO clip(1 − τ/f + βΔH) with τ = 0
        branch_probability=1.0 if strategy == "arpo" else 0.0,
        beam_size=2,
        per_device_train_batch_size=4,
        max_steps=1,
        max_completion_length=96,
        **extra,
    )
    seen = spy_loss(trainer)
    trainer.train()
    assert len(reward.calls) == 1 and len(reward.calls[0]["texts"]) == 4  # exactly n rows per group
    assert sum(s["completion_ids"].size(0) for s in seen) == 4  # every ARPO/AEPO row reaches the loss
    logged = {k: v for e in trainer.state.log_history for k, v in e.items()}
    assert logged["branch/points_per_prompt"] > 0  # P = 1: every tool result forks until the cap
    if strategy == "aepo":  # "reuse": the entropy probe is a group member, no extra rollout
        assert logged["branch/initial_per_prompt"] >= 2
    engine.close()


def test_appo_through_the_real_engine_drops_branch_rows(tmp_path, tiny_tokenizer, tiny_model_path, monkeypatch):
    engine, reward = real_engine(tiny_tokenizer, record_entropies=True, entropy_topk=2), RewardSpy()
    trainer = make_trainer(
        tmp_path,
        tiny_tokenizer,
        tiny_model_path,
        engine,
        reward,
        tools=["python"],
        rollout_strategy="appo",
        initial_rollouts=2,
        num_generations=4,
        per_device_train_batch_size=4,
        max_steps=1,
        max_completion_length=96,
        min_remaining_tokens=2,
    )
    seen = spy_loss(trainer)
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    assert len(reward.calls[0]["texts"]) == 4
    assert [s["completion_ids"].size(0) for s in seen] == [2]
    assert int(seen[0]["num_items_in_batch"]) == int((seen[0]["completion_mask"] * seen[0]["tool_mask"]).sum())
    assert engine.metrics()  # engine statistics are available for logging
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.named_parameters())
    engine.close()
