import math
import random

import pytest
import torch

from appo_trl.algorithms.arpo import (
    ARPOBranchState,
    aepo_consecutive_penalty,
    aepo_initial_rollouts,
    arpo_branch_probability,
    sample_branch_copies,
)
from appo_trl.algorithms.entropy import segment_entropy, topk_entropy


def test_arpo_probability():
    # τ + βΔH: 0.5 + 0.2·(3 - 2) = 0.7 ; ΔH = -5 -> 0.5 - 1 -> clip 0 ; ΔH = 4 -> 1.3 -> clip 1
    assert arpo_branch_probability(3.0, 2.0) == pytest.approx(0.7)
    assert arpo_branch_probability(-5.0) == 0.0 and arpo_branch_probability(4.0) == 1.0
    assert arpo_branch_probability(float("nan"), 1.0) == pytest.approx(0.5)  # unknown ΔH -> 0


def test_aepo_probability_matches_monte_carlo_of_reference_rule():
    # f = 0.9, τ = 0.5, β = 0.2, ΔH = 1: P = 1 - 0.5/0.9 + 0.2 = 0.644444
    f = aepo_consecutive_penalty(2, 0.05)
    assert f == pytest.approx(0.9)
    p = arpo_branch_probability(1.0, base=0.5, weight=0.2, penalty_factor=f)
    assert p == pytest.approx(1 - 0.5 / 0.9 + 0.2)
    # reference rule: branch iff clip(f·(u + βΔH), 0, 1) >= τ, estimated on a fixed grid of u
    us = [(i + 0.5) / 100000 for i in range(100000)]
    hits = sum(min(max(f * (u + 0.2), 0), 1) >= 0.5 for u in us) / len(us)
    assert hits == pytest.approx(p, abs=1e-4)
    # τ = 0.3, f = 1: AEPO 1 - 0.3 + 0 = 0.7 but ARPO 0.3 (the forms differ unless τ = 0.5)
    assert arpo_branch_probability(0.0, base=0.3, penalty_factor=1.0) == pytest.approx(0.7)
    assert arpo_branch_probability(0.0, base=0.3) == pytest.approx(0.3)
    assert arpo_branch_probability(5.0, penalty_factor=aepo_consecutive_penalty(30)) == 0.0  # f = max(0, -0.5) = 0


def test_aepo_initial_rollouts():
    assert aepo_initial_rollouts(1.0, 1.0, 16) == 9  # int(16·0.5) + 1
    # ΔH = 2, β = 0.5: σ(1) = 0.731059 -> int(11.697) + 1 = 12
    assert aepo_initial_rollouts(3.0, 1.0, 16) == 12
    assert aepo_initial_rollouts(1e6, 0.0, 16) == 16 and aepo_initial_rollouts(-1e6, 0.0, 16) == 1


class _Seq:
    def __init__(self, values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


def test_sample_branch_copies():
    # draws 0.1, 0.6, 0.2 against p = 0.5 -> successes at 0.1 and 0.2 -> 2
    assert sample_branch_copies(0.5, 3, _Seq([0.1, 0.6, 0.2])) == 2
    assert sample_branch_copies(0.5, 3, _Seq([0.1]), slots=1) == 1  # capped by remaining slots: one draw
    assert sample_branch_copies(1.0, 5, random.Random(0), slots=0) == 0


def test_branch_state():
    s = ARPOBranchState()
    s.set_root("a", 1.5)
    s.set_root("a", 9.0)  # first wins
    s.inherit("a.1", "a")
    assert s.root("a.1") == 1.5 and math.isnan(s.root("zz"))
    assert s.end_round("p", True) == 1 and s.end_round("p", True) == 2
    assert s.penalty_factor("p") == pytest.approx(0.9)
    assert s.end_round("p", False) == 0


def test_topk_entropy():
    # p = 0.5, 0.5 -> ln 2 ; p = 1 -> 0 ; -inf ignored ; dicts with .logprob objects
    lp = torch.tensor([[math.log(0.5), math.log(0.5)], [0.0, float("-inf")]])
    assert topk_entropy(lp).tolist() == pytest.approx([math.log(2), 0.0])

    class LP:
        def __init__(self, x):
            self.logprob = x

    # p = [0.7, 0.2]: -(0.7 ln 0.7 + 0.2 ln 0.2) = 0.249672 + 0.321888 = 0.571560
    h = topk_entropy([{1: LP(math.log(0.7)), 2: math.log(0.2)}, None])
    assert h[0].item() == pytest.approx(0.571560, rel=1e-5) and math.isnan(h[1].item())


def test_segment_entropy():
    assert segment_entropy([1.0, 2.0, 3.0], window=2) == pytest.approx(3.0)
    assert segment_entropy([1.0, 2.0, 3.0], window=2, vocab_size=round(math.e**2)) == pytest.approx(
        3.0 / math.log(round(math.e**2))
    )
    assert segment_entropy([1.0, 2.0, 3.0], reduce="mean") == pytest.approx(2.0)
    assert math.isnan(segment_entropy([]))
    with pytest.raises(ValueError):
        segment_entropy([1.0], reduce="max")
