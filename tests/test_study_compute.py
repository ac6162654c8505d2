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


def family_run(strategy, seed, tokens_per_step, chain):
    r = run(strategy, seed, tokens_per_step, {})
    r["evals"] = {step: {"pass@1": 0.0, "by_family": {"chain": c}} for step, c in chain.items()}
    return r


CHAIN_RUNS = [
    family_run("grpo", 0, 100, {"2": 0.3, "4": 0.5}),  # chain 0.3 at 200 tokens, 0.5 at 400
    family_run("arpo", 0, 50, {"2": 0.2, "4": 0.6}),  # 0.2 at 100, 0.6 at 200
    family_run("arpo", 1, 30, {"2": 0.4, "4": 0.4}),  # 0.4 at 60, 0.4 at 120: ends below 150
]


def test_one_familys_pass_at_1_at_a_budget_fixed_in_advance():
    assert curve(CHAIN_RUNS[1], "sampled_tokens", 0.1, "chain") == [(0.0, 0.1), (100.0, 0.2), (200.0, 0.6)]
    m = matched_budget(CHAIN_RUNS, "sampled_tokens", 0.1, family="chain", budget=150.0)
    assert m["budget"] == 150.0 and m["cheapest"] == "arpo"  # arpo's mean final budget 160 < grpo's 400
    grpo, arpo = m["strategies"]["grpo"], m["strategies"]["arpo"]
    assert grpo["per_seed"] == pytest.approx([0.1 + 0.2 * 150 / 200])  # SFT 0.1 at 0 -> 0.3 at 200: 0.25
    assert arpo["per_seed"][0] == pytest.approx(0.2 + 0.4 * 50 / 100) and arpo["per_seed"][1] is None  # 0.4
    assert arpo["mean"] == pytest.approx(0.4) and arpo["sd"] == 0.0  # the run that ended below 150 is left out
    default = matched_budget(CHAIN_RUNS, "sampled_tokens", 0.1, family="chain")  # the smallest final: 120
    assert default["budget"] == 120.0
    assert default["strategies"]["arpo"]["per_seed"] == pytest.approx([0.2 + 0.4 * 20 / 100, 0.4])  # 0.28, 0.4
    with pytest.raises(ValueError, match="grpo seed 0 step 2: no pass@1 of family 'python'"):
        curve(CHAIN_RUNS[0], "sampled_tokens", 0.1, "python")
