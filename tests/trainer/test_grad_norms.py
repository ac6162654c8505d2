"""Huge advantages never train silently (issue 48, cause 2): `check_credit` bounds the tree-credit weights before
the model loads, and the trainer says so when a step's grad norm is not finite (`trainer/grad_norms.py`)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from appo_trl.trainer.grad_norms import STREAK, GradNormError, GradNormWatch


def _config(tmp_path, **kw):
    from appo_trl.config import APPOConfig
    from tests.trainer.test_trainer import CPU

    return APPOConfig(output_dir=str(tmp_path), **CPU, num_generations=4, per_device_train_batch_size=4,
                      rollout_strategy="arpo", advantage_estimator="tree", **kw)  # fmt: skip


@pytest.mark.parametrize("weights", [(1e30, 1.0), (1.0, 1e39), (6e5, 6e5)])
def test_tree_credit_weights_past_float32_are_refused_in_one_line(tmp_path, weights):
    with pytest.raises(ValueError, match=r"sum to over 1e\+06: the float32 advantages would overflow") as err:
        _config(tmp_path, tree_credit_global_weight=weights[0], tree_credit_local_weight=weights[1])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("weights, expected", [
    (("1.0", 1.0), "tree_credit_global_weight='1.0' must be a number."),  # before: TypeError "must be real number"
    ((True, 1.0), "tree_credit_global_weight=True must be a number."),
    ((0.0, 1e-320), "sum to under 1.2e-38, which is 0 in float32"),  # before: taken, every advantage 0
])  # fmt: skip
def test_tree_credit_weights_that_are_not_numbers_or_vanish_in_float32_are_refused(tmp_path, weights, expected):
    with pytest.raises(ValueError) as err:
        _config(tmp_path, tree_credit_global_weight=weights[0], tree_credit_local_weight=weights[1])
    assert expected in str(err.value)


def test_tree_credit_weights_up_to_the_bound_are_taken(tmp_path):
    assert _config(tmp_path, tree_credit_global_weight=5e5, tree_credit_local_weight=5e5).tree_credit_global_weight \
        == 5e5  # fmt: skip


def test_the_first_non_finite_grad_norm_is_one_warning_and_a_streak_stops_the_run(caplog):
    watch = GradNormWatch(max_steps=100)
    with caplog.at_level(logging.WARNING, logger="appo_trl.trainer.grad_norms"):
        watch.step(torch.tensor(2.0), 1)
        watch.step(torch.tensor(math.inf), 2)
        watch.step(torch.tensor(math.inf), 2)  # the epoch's end passes step 2's norm again: not a second step
        watch.step(1.5, 3)  # a finite step ends the streak
        for step in range(4, 4 + STREAK - 1):
            watch.step(float("nan"), step)
        assert watch.bad_steps == STREAK
        [line] = [r.getMessage() for r in caplog.records]
        assert line.startswith("step 2: the grad norm is inf, so this step's update is lost") and "\n" not in line
        with pytest.raises(GradNormError, match=f"the grad norm was nan at {STREAK} optimizer steps in a row"):
            watch.step(float("nan"), 4 + STREAK - 1)
    assert watch.step(None, 99) is None  # no norm computed: nothing to say


def test_a_run_shorter_than_the_streak_stops_once_every_step_was_non_finite():
    watch = GradNormWatch(max_steps=2)
    watch.step(math.inf, 1)
    with pytest.raises(GradNormError, match="at 2 optimizer steps in a row"):
        watch.step(math.inf, 2)


@pytest.mark.parametrize("scale, expected", [
    (1e25, "at 2 optimizer steps in a row"),  # finite gradients whose squared norm overflows: every update zeroed
    (1e60, "step 1: the grad norm was .* and the weights are no longer finite"),  # an inf loss: NaN weights
])  # fmt: skip
def test_a_training_run_whose_grad_norm_is_not_finite_stops_with_one_line(scale, expected, tmp_path, tiny_tokenizer,
                                                                          tiny_model_path):  # fmt: skip
    """Real runs whose loss is scaled as advantages of 1e30 scale it: before the watch the first exited 0 with
    `grad_norm: inf` at every step and its weights unchanged, the second died in sampling on NaN weights."""
    from tests.trainer.test_trainer import make_trainer

    def length(completions, **kw):
        return [float(len(c[0]["content"])) for c in completions]

    trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, None, length, num_generations=4,
                           per_device_train_batch_size=4, max_steps=2, max_completion_length=8)  # fmt: skip
    compute = trainer._compute_loss
    trainer._compute_loss = lambda model, inputs: compute(model, inputs) * 1e30 * (scale / 1e30)
    with pytest.raises(GradNormError, match=expected):
        trainer.train()


@pytest.mark.parametrize("kind", ["grad", "reward"])
def test_the_stage_ends_with_one_line_on_these_errors(kind, capsys, tmp_path):
    from appo_trl.stages.interrupts import run_interruptible
    from appo_trl.trainer.reward_checks import RewardFunctionError

    exc = GradNormError("the grad norm was inf") if kind == "grad" else RewardFunctionError("reward 'f' returned x")

    def fn():
        raise RuntimeError("round failed") from exc

    assert run_interruptible("appo train", str(tmp_path), fn) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"appo train: error: {exc}"), err
