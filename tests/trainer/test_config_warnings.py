"""Valid settings that make a strategy do nothing useful are warned about at config time."""

from __future__ import annotations

import warnings

import pytest

from appo_trl.config import APPOConfig

BASE = dict(output_dir="/tmp/appo-config-test", use_cpu=True, bf16=False, report_to="none", save_strategy="no",
            num_generations=4, per_device_train_batch_size=4)  # fmt: skip


def test_appo_min_remaining_at_or_above_the_budget_warns_every_point_is_a_fallback():
    # a candidate t needs budget − (t + 1) ≥ min_remaining: with min_remaining ≥ budget not even t = 0 qualifies
    for min_remaining in (64, 65):
        with pytest.warns(UserWarning, match=r"min_remaining_tokens=6[45] >= max_completion_length=64.*fallback"):
            APPOConfig(**BASE, rollout_strategy="appo", max_completion_length=64, min_remaining_tokens=min_remaining)


@pytest.mark.parametrize(
    "kw",
    [
        dict(rollout_strategy="appo", max_completion_length=64, min_remaining_tokens=63),  # t = 0 still qualifies
        dict(rollout_strategy="appo", max_completion_length=64, min_remaining_tokens=64, initial_rollouts=4),
        dict(rollout_strategy="grpo", max_completion_length=32, min_remaining_tokens=64),  # no branching
    ],
)
def test_no_warning_when_branch_points_exist_or_nothing_branches(kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        APPOConfig(**BASE, **kw)
