"""One canonical name per logged quantity, TRL's own keys kept, and one readable console line per step."""

from __future__ import annotations

import math

import pytest

from appo_trl.reporting.console import accuracy_of, canonical_metrics, format_step_line

DUPLICATES = ("tools/calls_per_round", "rollout/tool_calls", "rollout/tool/python/calls", "rollout/tool_failures",
              "rollout/tool/python/failures", "rollout/tool/python/time_s", "rollout/tokens_sampled")  # fmt: skip


def test_canonical_metrics_drops_each_duplicate_of_a_canonical_key():
    raw = {
        "rollout/tool_calls": 3.0, "rollout/tool/python/calls": 3.0, "rollout/tool/python/failures": 1.0,
        "rollout/tool/python/time_s": 0.3, "rollout/tool_failures": 1.0, "rollout/tokens_sampled": 90.0,
        "tools/calls": 3.0, "tools/python/calls": 3.0, "tools/python/failures": 1.0,
        "rollout/tokens_per_s": 30.0, "rollout/branches": 2.0, "rollout/tool_time_s": 0.3,
    }  # fmt: skip
    assert canonical_metrics(raw) == {
        "tools/calls": 3.0, "tools/python/calls": 3.0, "tools/python/failures": 1.0,
        "rollout/tokens_per_s": 30.0, "rollout/branches": 2.0, "rollout/tool_time_s": 0.3,
    }  # fmt: skip


def test_step_line_reads_like_a_sentence():
    logs = {
        "loss": 0.01234, "reward": -0.4123, "reward_std": 0.31, "rewards/math_verify/mean": 0.25,
        "tools/call_frequency": 1.5, "tools/failure_frequency": 0.0, "branch/points_per_prompt": 2.0,
        "completions/mean_length": 71.6, "step_time": 1.016, "learning_rate": 1e-3, "rollout/branches": 2.0,
    }  # fmt: skip
    assert format_step_line(logs, 3, 10) == (
        "step 3/10 | reward -0.412 ±0.310 | acc 25.0% | tools 1.50/compl | branches 2.0/prompt | loss 0.01234 "
        "| len 72 | 1.02 s"
    )
    # no accuracy without a 0/1 reward, no branches for grpo, failures shown when there are some
    line = format_step_line({"reward": 0.5, "tools/call_frequency": 2.0, "tools/failure_frequency": 0.25}, 1)
    assert line == "step 1 | reward 0.500 | tools 2.00/compl (fail 25%)"
    assert (
        format_step_line({"train_runtime": 12.34, "train_loss": 0.5}, 4) == "done: 4 steps in 12.3 s | mean loss 0.5"
    )
    assert format_step_line({"eval_reward": 0.1, "eval_rewards/qa_em/mean": 0.5}, 2, 4) == (
        "eval step 2/4 | reward 0.100 | acc 50.0%"
    )


def test_accuracy_only_where_known():
    assert accuracy_of({"rewards/arpo_deep_research/mean": 0.4}) is None  # F1-based: not an accuracy
    assert accuracy_of({"rewards/qa_em/mean": 0.75}) == 0.75
    assert accuracy_of({"accuracy": 0.5, "rewards/qa_em/mean": 0.75}) == 0.5
    assert accuracy_of({"rewards/math_verify/mean": math.nan}) is None


@pytest.mark.slow
def test_appo_step_logs_each_quantity_once_and_one_console_line(tmp_path, tiny_tokenizer, tiny_model_path, capsys):
    from tests.trainer.test_trainer import RewardSpy, make_trainer
    from tests.trainer.test_trainer_engine import real_engine

    engine = real_engine(tiny_tokenizer, record_entropies=True, entropy_topk=2)
    trainer = make_trainer(
        tmp_path, tiny_tokenizer, tiny_model_path, engine, RewardSpy(), tools=["python"], rollout_strategy="appo",
        initial_rollouts=2, num_generations=4, per_device_train_batch_size=4, max_steps=1,
        max_completion_length=96, min_remaining_tokens=2,
    )  # fmt: skip
    trainer.train()
    engine.close()
    step = trainer.state.log_history[0]
    assert not set(DUPLICATES) & set(step), sorted(set(DUPLICATES) & set(step))
    assert step["tools/calls"] == step["tools/python/calls"] == 4  # 2 initial rollouts + 2 branches, 1 call each
    assert step["tools/call_frequency"] == 1.0
    for key in ("mean_terminated_length", "min_terminated_length", "max_terminated_length", "mean_length"):
        assert f"completions/{key}" in step
    assert step["completions/max_terminated_length"] <= step["completions/max_length"]
    out = capsys.readouterr()
    console = out.out + out.err
    assert "step 1/1 | reward " in console and "tools 1.00/compl" in console and "branches " in console
    assert "{'loss'" not in console and "'rollout/" not in console  # no metric dict wall


def test_step_line_shows_the_tree_forward_ratio():
    line = format_step_line({"reward": 0.5, "tree/tokens_ratio": 0.3061, "step_time": 2.0}, 1)
    assert line == "step 1 | reward 0.500 | tree 0.31x | 2.00 s"
