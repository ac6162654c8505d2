import math

import pytest
import torch

from appo_trl.algorithms.advantages import appo_dual_group_advantages, entropy_aware_advantage, group_advantages


def test_group_advantages_population_and_unbiased():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    # group 1: mean 0.25, pop var = (0.5625 + 3·0.0625)/4 = 0.1875, std 0.43301 -> A0 = 0.75/0.43301 = 1.73205
    a = group_advantages(r, 4, std="population", eps=0.0)
    assert a[:4].tolist() == pytest.approx([1.7320508, -0.5773503, -0.5773503, -0.5773503], rel=1e-5)
    # constant group: centred 0 / (std 0 + eps 1e-4) -> 0
    assert group_advantages(r, 4)[4:].abs().sum() == 0
    # unbiased: var = 0.75/3 = 0.25, std 0.5 -> A0 = 0.75/0.5 = 1.5
    a = group_advantages(r[:4], 4, std="unbiased", eps=0.0)
    assert a[0].item() == pytest.approx(1.5)
    assert group_advantages(torch.tensor([0.7]), 1, std="unbiased").tolist() == pytest.approx([0.7 / (1 + 1e-4)])
    assert group_advantages(r[:4], 4, scale="none").tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    with pytest.raises(ValueError):
        group_advantages(r, 3)


def test_appo_dual_group_hand_computed():
    # P=1, N=2 initial rewards [1, 0] -> Â = [1, -1] (mean .5, pop std .5; eps 1e-6 ignored at 1e-5 tolerance)
    # B=2 branches, both off row 0, rewards [1, 0] -> Â^br = [1, -1]; s = [1, 3]; BS = [2, 1] -> w = [1, 0.5]
    # δ = 0.5, T = 5, lengths [5, 5].
    # t=0: both cover: m = mean(1 + 1·0.5^1, 1 + 0.5·0.5^3) = mean(1.5, 1.0625) = 1.28125; credit mean(1, -1) = 0
    #      A = 1.28125·1 + 0 = 1.28125
    # t=1: both: m = mean(1 + 1, 1 + 0.5·0.25) = mean(2, 1.125) = 1.5625; credit 0 -> 1.5625
    # t=2: only b2 (s=3): m = 1 + 0.5·0.5 = 1.25; credit -1 -> 0.25
    # t=3: only b2: m = 1 + 0.5 = 1.5; credit -1 -> 0.5
    # t=4: none -> Â = 1.   Row 1 has no branches -> -1 everywhere.
    adv = appo_dual_group_advantages(
        initial_rewards=torch.tensor([[1.0, 0.0]]),
        branch_rewards=torch.tensor([[1.0, 0.0]]),
        branch_rows=torch.tensor([[0, 0]]),
        branch_positions=torch.tensor([[1, 3]]),
        branch_scores=torch.tensor([[2.0, 1.0]]),
        lengths=torch.tensor([[5, 4]]),
        max_length=5,
        discount=0.5,
    )
    assert adv[0].tolist() == pytest.approx([1.28125, 1.5625, 0.25, 0.5, 1.0], rel=1e-5)
    assert adv[1].tolist() == pytest.approx([-1.0, -1.0, -1.0, -1.0, 0.0], rel=1e-5)  # length 4 -> t=4 is 0
    # reward_noop: m ≡ 1 -> row 0 = [1, 1, 0, 0, 1]
    adv = appo_dual_group_advantages(
        initial_rewards=torch.tensor([[1.0, 0.0]]),
        branch_rewards=torch.tensor([[1.0, 0.0]]),
        branch_rows=torch.tensor([[0, 0]]),
        branch_positions=torch.tensor([[1, 3]]),
        branch_scores=torch.tensor([[2.0, 1.0]]),
        max_length=5,
        discount=0.5,
        m_scaling="reward_noop",
    )
    assert adv[0].tolist() == pytest.approx([1.0, 1.0, 0.0, 0.0, 1.0], rel=1e-5)


def test_appo_non_positive_scores():
    # BS = [-1, 2]: w = [0, 1]. Branch 0 (s=0, row 1, Â^br = -1), branch 1 (s=0, row 0, Â^br = +1); δ irrelevant at t=s
    # row 0 t=0: m = 1 + 1·1 = 2; A = 2·1 + 1 = 3 ; row 1 t=0: m = 1 + 0 = 1; A = 1·(-1) + (-1) = -2
    kw = dict(
        initial_rewards=torch.tensor([[1.0, 0.0]]),
        branch_rewards=torch.tensor([[0.0, 1.0]]),
        branch_rows=torch.tensor([[1, 0]]),
        branch_positions=torch.tensor([[0, 0]]),
        max_length=2,
        discount=0.9,
    )
    adv = appo_dual_group_advantages(branch_scores=torch.tensor([[-1.0, 2.0]]), **kw)
    assert adv[:, 0].tolist() == pytest.approx([3.0, -2.0], rel=1e-5)
    # all BS <= 0 -> no scale at all: row 0 t=0: 1 + 1 = 2 ; row 1: -1 - 1 = -2
    adv = appo_dual_group_advantages(branch_scores=torch.tensor([[-1.0, 0.0]]), **kw)
    assert adv[:, 0].tolist() == pytest.approx([2.0, -2.0], rel=1e-5)
    # bare-prompt point (s = -1) covers nothing
    kw["branch_positions"] = torch.tensor([[-1, -1]])
    adv = appo_dual_group_advantages(branch_scores=torch.tensor([[1.0, 1.0]]), **kw)
    assert adv.tolist() == [pytest.approx([1.0, 1.0], rel=1e-5), pytest.approx([-1.0, -1.0], rel=1e-5)]


def test_entropy_aware_advantage():
    # valid H = [1, 3] (third masked): μ = 2, unbiased σ = √2 -> z = [-0.70711, 0.70711]
    # a = 0.2: factors [0.858579, 1.141421]; A = 2 (per sequence) -> [1.717157, 2.282843]
    H = torch.tensor([[1.0, 3.0, 50.0]])
    out = entropy_aware_advantage(torch.tensor([2.0]), H, torch.tensor([[1, 1, 0]]), weight=0.2)
    assert out[0, :2].tolist() == pytest.approx([2 * (1 - 0.2 / math.sqrt(2)), 2 * (1 + 0.2 / math.sqrt(2))], rel=1e-5)
    # masked token z = 48/√2 -> factor 7.79 clamped to 2 -> 4
    assert out[0, 2].item() == pytest.approx(4.0)
    # no clamp: reference behaviour (factor 1 + 0.2·48/√2)
    out = entropy_aware_advantage(torch.tensor([2.0]), H, torch.tensor([[1, 1, 0]]), weight=0.2, clamp=None)
    assert out[0, 2].item() == pytest.approx(2 * (1 + 0.2 * 48 / math.sqrt(2)), rel=1e-5)
    # constant entropy: σ := 1, z = 0 -> unchanged
    A = torch.tensor([[1.0, -1.0]])
    assert torch.equal(entropy_aware_advantage(A, torch.ones(1, 2), torch.ones(1, 2)), A)
