"""Broken reward functions stop the run with one error naming them (appo_trl.trainer.reward_checks).

Before: a reward returning strings failed inside TRL with `too many dimensions 'str'` (no function named), and a
reward returning None for everything trained nothing for the whole run, warning each step, and exited 0.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from appo_trl.config import APPOConfig
from appo_trl.trainer.reward_checks import NaNRewardGuard, RewardFunctionError, check_rewards, checked_reward_func
from tests.trainer.test_trainer import CPU
from tests.trainer.test_trainer_engine import real_engine


def test_check_rewards_accepts_numbers_and_none_and_names_the_function_otherwise():
    check_rewards("f", [1, 0.5, None, math.nan, True, np.float32(2), torch.tensor(1.0), np.array(3.0)])
    check_rewards("f", np.array([1.0, 2.0]))
    with pytest.raises(RewardFunctionError, match=r"reward function 'f' returned str '1.0' for completion 1; "):
        check_rewards("f", [1.0, "1.0"])
    with pytest.raises(RewardFunctionError, match=r"reward function 'g' returned str 'good'; it must return a list"):
        check_rewards("g", "good")
    with pytest.raises(RewardFunctionError, match=r"returned list \[1, 2\] for completion 0"):
        check_rewards("h", [[1, 2]])


def test_checked_reward_func_keeps_the_name_and_async():
    def sync_reward(completions, **kw):
        return ["x"] * len(completions)

    async def async_reward(completions, **kw):
        return ["y"] * len(completions)

    wrapped = checked_reward_func(sync_reward, "sync_reward")
    assert wrapped.__name__ == "sync_reward"
    with pytest.raises(RewardFunctionError, match="'sync_reward' returned str 'x'"):
        wrapped(completions=["a"])
    awrapped = checked_reward_func(async_reward, "async_reward")
    assert asyncio.iscoroutinefunction(awrapped)
    with pytest.raises(RewardFunctionError, match="'async_reward' returned str 'y'"):
        asyncio.run(awrapped(completions=["a"]))


def test_guard_counts_rounds_in_a_row_without_any_reward():
    nan, ok = torch.full((4, 2), math.nan), torch.tensor([[math.nan, 1.0]] + [[math.nan, math.nan]] * 3)
    guard = NaNRewardGuard(3)
    guard.update(nan, ["a", "b"], 1)
    guard.update(nan, ["a", "b"], 2)
    guard.update(ok, ["a", "b"], 3)  # one reward anywhere resets the count
    assert guard.streak == 0
    guard.update(nan, ["a", "b"], 4)
    guard.update(nan, ["a", "b"], 5)
    with pytest.raises(RewardFunctionError, match=r"'a', 'b' returned None/NaN for every completion in 3 training "):
        guard.update(nan, ["a", "b"], 6)
    off = NaNRewardGuard(0)
    for step in range(10):
        off.update(nan, ["a"], step)


def test_config_rejects_a_negative_limit(tmp_path):
    with pytest.raises(ValueError, match="max_nan_reward_steps=-1 must be >= 0"):
        APPOConfig(output_dir=str(tmp_path), max_nan_reward_steps=-1, **CPU)


def _trainer(tmp_path, tokenizer, model_path, reward, **kw):
    from datasets import Dataset

    from appo_trl.trainer.trainer import APPOTrainer

    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"what is {i} times 4"}] for i in range(8)]})
    args = APPOConfig(output_dir=str(tmp_path), tools=["python"], num_generations=2, per_device_train_batch_size=2,
                      max_completion_length=96, **{**CPU, **kw})  # fmt: skip
    return APPOTrainer(model=model_path, reward_funcs=[reward], args=args, train_dataset=data,
                       processing_class=tokenizer, rollout_engine=real_engine(tokenizer))  # fmt: skip


def test_a_reward_returning_strings_is_named(tmp_path, tiny_tokenizer, tiny_model_path):
    def verdict_reward(completions, **kw):
        return ["correct" for _ in completions]

    trainer = _trainer(tmp_path, tiny_tokenizer, tiny_model_path, verdict_reward, max_steps=1)
    with pytest.raises(RewardFunctionError, match=r"^reward function 'verdict_reward' returned str 'correct' for "):
        trainer.train()


def test_a_reward_that_is_always_none_stops_after_max_nan_reward_steps(tmp_path, tiny_tokenizer, tiny_model_path):
    calls = []

    def broken_reward(completions, **kw):
        calls.append(len(completions))
        return [None] * len(completions)

    trainer = _trainer(tmp_path, tiny_tokenizer, tiny_model_path, broken_reward, max_steps=6, max_nan_reward_steps=2)
    with pytest.raises(RewardFunctionError, match=r"'broken_reward' returned None/NaN for every completion in 2 "):
        trainer.train()
    assert len(calls) == 2 and trainer.state.global_step == 1  # stopped in the second round, not after 6 steps


def test_a_round_without_rewards_warns_and_trains_on_by_default(caplog):
    """TRL's `test_warning_raised_all_rewards_none` semantics (issue 34): a warning per round, no stop unless
    `max_nan_reward_steps` is set."""
    nan = torch.full((4, 1), math.nan)
    guard = NaNRewardGuard(APPOConfig.max_nan_reward_steps)
    with caplog.at_level("WARNING", logger="appo_trl.trainer.reward_checks"):
        for step in range(1, 6):
            guard.update(nan, ["r"], step)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5 and lines[4].startswith("step 5: reward function(s) 'r' returned None/NaN")
    assert "round 5 in a row" in lines[4] and "stops" not in lines[4]


def test_non_finite_rewards_are_none_with_one_warning_per_function(caplog):
    """inf, -inf, 1e308 (float32 overflow in the group std), NaN: None, as TRL's None; one warning naming the function."""

    def log_reward(completions, **kw):
        return [math.inf, -math.inf, 1e308, math.nan, 1.0, None, np.float64(1e15)]

    async def async_log_reward(completions, **kw):
        return torch.tensor([-math.inf, 2.0])

    wrapped = checked_reward_func(log_reward, "log_reward")
    with caplog.at_level("WARNING", logger="appo_trl.trainer.reward_checks"):
        assert wrapped(completions=[]) == [None, None, None, None, 1.0, None, 1e15]  # 1e15: REWARD_LIMIT, kept
        assert wrapped(completions=[]) == [None, None, None, None, 1.0, None, 1e15]
        assert asyncio.run(checked_reward_func(async_log_reward, "async_log_reward")(completions=[])) == [None, 2.0]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("reward function 'log_reward' returned inf for completion 0;")
    assert lines[1].startswith("reward function 'async_log_reward' returned -inf for completion 0;")
    assert checked_reward_func(log_reward, "f")(completions=[])[4] == 1.0
    finite = [0.5, None]
    assert checked_reward_func(lambda **kw: finite, "g")() is finite  # nothing to change: the very list


def test_an_infinite_reward_function_trains_with_finite_rewards(tmp_path, tiny_tokenizer, tiny_model_path, caplog):
    def log_zero_reward(completions, **kw):
        return [-math.inf] + [float(i % 2) for i in range(1, len(completions))]

    trainer = _trainer(tmp_path, tiny_tokenizer, tiny_model_path, log_zero_reward, max_steps=2)
    with caplog.at_level("WARNING", logger="appo_trl.trainer.reward_checks"):
        trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 2 and all(h["reward"] == 1.0 for h in logs)  # the other row's (before: -inf)
    assert sum("log_zero_reward" in r.getMessage() for r in caplog.records) == 1


def test_non_finite_per_turn_rewards_are_not_recorded_and_none_with_one_warning(caplog):
    """A per-turn list holding inf (or summing past REWARD_LIMIT) is the completion's None, as a number would be, and
    never reaches the tree credit (before: the turns were recorded before the check, so inf reached the credit)."""

    def turn_reward(completions, **kw):
        return [[0.5, math.inf], [1.0, 2.0], [9e14, 9e14], [-math.inf]]

    recorded = {}
    wrapped = checked_reward_func(turn_reward, "turn_reward", lambda name, i, values: recorded.update({i: values}))
    with caplog.at_level("WARNING", logger="appo_trl.trainer.reward_checks"):
        assert wrapped(completions=[]) == [None, 3.0, None, None]
        assert wrapped(completions=[]) == [None, 3.0, None, None]
    assert recorded == {1: [1.0, 2.0]}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("reward function 'turn_reward' returned inf for completion 0;")
