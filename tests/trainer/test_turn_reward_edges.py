"""Per-turn reward lists at their edges (issue 48, causes 8-10): a broken list ends the run in one line (exit 1),
NaN inside a list follows the README's rule (the completion is None, one warning), and a 2-d array with tree credit
on gets a hint that fits."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from appo_trl.trainer.reward_checks import RewardFunctionError, checked_reward_func
from tests.trainer.test_turn_rewards import TurnReward, make


def _checked(output):
    recorded = []
    func = checked_reward_func(lambda **kw: output, "f", turns=lambda name, i, values: recorded.append((i, values)))
    return func(), recorded


def test_nan_or_inf_inside_a_per_turn_list_makes_that_completion_none_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="appo_trl.trainer.reward_checks"):
        out, recorded = _checked([[0.5, float("nan")], [1.0, 2.0], [math.inf, 0.0], [np.float32(0.25), 1]])
    assert out == [None, 3.0, None, 1.25] and recorded == [(1, [1.0, 2.0]), (3, [0.25, 1.0])]
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("reward function 'f' returned NaN for completion 0;")


@pytest.mark.parametrize("output, expected", [
    ([[1.0, None]], "returned per-turn rewards [1.0, None] for completion 0; each turn's reward must be a number"),
    ([["1", 2.0]], "each turn's reward must be a number"),
    ([[[1.0], 2.0]], "each turn's reward must be a number"),
])  # fmt: skip
def test_what_is_not_a_number_inside_a_list_is_one_line(output, expected):
    with pytest.raises(RewardFunctionError) as err:
        _checked(output)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_a_2d_array_with_tree_credit_on_is_not_told_to_turn_it_on():
    with pytest.raises(RewardFunctionError) as err:
        _checked(np.array([[1.0], [0.0]]))
    assert "set advantage_estimator=tree" not in str(err.value)
    assert "a 2-d array is not read as turns: return .tolist()" in str(err.value)
    func = checked_reward_func(lambda **kw: np.array([[1.0], [0.0]]), "f")  # tree credit off: that hint stands
    with pytest.raises(RewardFunctionError, match="set advantage_estimator=tree"):
        func()


class Broken(TurnReward):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def __call__(self, completions, **kw):
        out = super().__call__(completions, **kw)
        return [[*turns, 1.0] if self.kind == "length" else [turns[0], None] for turns in out]


@pytest.mark.parametrize("kind, tree, expected", [
    ("length", True, "returned 3 per-turn rewards for completion 0, which has 2 assistant turn(s)"),
    ("none", True, "each turn's reward must be a number"),
    ("length", False, "per-turn rewards: set advantage_estimator=tree"),
])  # fmt: skip
def test_a_broken_per_turn_list_ends_the_stage_in_one_line(kind, tree, expected, tiny_chat_model_path,
                                                           tiny_chat_tokenizer, tmp_path, capsys):  # fmt: skip
    from appo_trl.stages.interrupts import run_interruptible

    trainer = make(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path, Broken(kind),
                   **({"advantage_estimator": "tree"} if tree else {}))  # fmt: skip
    assert run_interruptible("appo train", str(tmp_path), trainer.train) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("appo train")]
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in lines[0], lines


def test_nan_inside_a_per_turn_list_trains_on(tiny_chat_model_path, tiny_chat_tokenizer, tmp_path):
    class NaNTurn(TurnReward):
        def __call__(self, completions, **kw):
            out = super().__call__(completions, **kw)
            return [[math.nan, turns[1]] if i == 0 else turns for i, turns in enumerate(out)]

    trainer = make(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path, NaNTurn(), advantage_estimator="tree")
    trainer.train()  # completed; before the fix: RewardFunctionError "each turn's reward must be a number"
    assert trainer.state.global_step == 1
