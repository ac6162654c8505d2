"""Accuracy at matched compute (`appo_trl.synthetic.compute`), with hand-computed numbers."""

import math

import pytest

from appo_trl.synthetic.compute import accuracy_at, cumulative, curve, matched_budget

SFT = 0.5


def run(strategy, seed, tokens_per_step, evals):
    history = [{"step": s, "sampled_tokens": tokens_per_step, "tool_calls": 2} for s in (1, 2, 3, 4)]
    return {"strategy": strategy, "seed": seed, "history": history, "evals": evals}


RUNS = [
    run("grpo", 0, 100, {"2": {"pass@1": 0.6}, "4": {"pass@1": 0.8}}),  # 100, 200, 300, 400 tokens
    run("appo", 0, 50, {"2": {"pass@1": 0.55}, "4": {"pass@1": 0.7}}),  # 50, 100, 150, 200
    run("appo", 1, 60, {"2": {"pass@1": 0.5}, "4": {"pass@1": 0.9}}),  # 60, 120, 180, 240
]


def test_cumulative_and_curve():
    assert cumulative(RUNS[0]["history"], "sampled_tokens") == {1: 100, 2: 200, 3: 300, 4: 400}
    assert cumulative(RUNS[0]["history"], "wall_s") == {1: 0, 2: 0, 3: 0, 4: 0}  # a missing figure counts 0
    assert curve(RUNS[2], "sampled_tokens", SFT) == [(0.0, 0.5), (120.0, 0.5), (240.0, 0.9)]


def test_interpolation_between_checkpoints_never_beyond_the_end():
    points = [(0.0, 0.5), (120.0, 0.5), (240.0, 0.9)]
    assert accuracy_at(points, 200.0) == pytest.approx(0.5 + 0.4 * 80 / 120)  # 0.76667
    assert accuracy_at(points, 0.0) == 0.5 and accuracy_at(points, 240.0) == 0.9
    assert accuracy_at(points, 241.0) is None


def test_matched_budget_is_where_the_cheapest_strategy_finished():
    m = matched_budget(RUNS, "sampled_tokens", SFT)
    # appo spent 200 and 240 tokens in K = 4 steps (mean 220), grpo 400: appo is the cheapest, and the smallest
    # final budget of any run is 200
    assert m["cheapest"] == "appo" and m["budget"] == 200.0
    grpo, appo = m["strategies"]["grpo"], m["strategies"]["appo"]
    assert grpo["mean"] == pytest.approx(0.6) and grpo["sd"] == 0.0  # grpo at 200 tokens: its step-2 checkpoint
    assert appo["per_seed"] == pytest.approx([0.7, 0.5 + 0.4 * 80 / 120])
    assert appo["mean"] == pytest.approx((0.7 + 0.766667) / 2, abs=1e-6)
    assert appo["sd"] == pytest.approx(abs(0.7 - 0.766667) / math.sqrt(2), abs=1e-6)  # 0.04714
    assert grpo["final_budget"] == 400.0 and appo["final_budget"] == 220.0


def test_equal_budgets_compare_at_the_end():
    m = matched_budget(RUNS, "tool_calls", SFT)  # every run made 8 calls: all compared after K steps
    assert m["budget"] == 8.0
    assert m["strategies"]["grpo"]["mean"] == pytest.approx(0.8)
    assert m["strategies"]["appo"]["mean"] == pytest.approx(0.8)
