"""Tree credit (appo_trl.algorithms.tree_credit): hand-computed trees, the no-branch reductions to GRPO, shared tokens."""

import random

import pytest
import torch

from appo_trl.algorithms.tree_credit import lineage_order, runs, tree_credit

S3, S2 = 3**0.5, 2**0.5


def test_three_levels_two_branch_points_on_one_row():
    # A root (r 1, 6 tokens); B = A@2 (r 0); C = A@4 (r 1); D = C@5 (r 0); E an independent root (r 0)
    # V(root) = 2/5 = 0.4. Nodes: A[0,2) {A,B,C,D} V .5; A[2,4) {A,C,D} V 2/3; A[4,6) {A} V 1; B[2,5) {B} V 0;
    # C[4,5) {C,D} V .5; C[5,7) {C} V 1; D[5,6) {D} V 0; E[0,3) {E} V 0. Token value
    # ((V − .4) + (V − V(parent))) / sqrt(rows):
    a0 = (0.1 + 0.1) / 2  # A[0,2): parent root
    a1 = ((2 / 3 - 0.4) + (2 / 3 - 0.5)) / S3  # A[2,4): parent A[0,2)
    a2 = 0.6 + 1 / 3  # A[4,6): parent A[2,4)
    b = -0.4 - 0.5  # B[2,5): parent A[0,2)
    c1 = (0.1 + (0.5 - 2 / 3)) / S2  # C[4,5): parent A[2,4)
    c2 = 0.6 + 0.5  # C[5,7): parent C[4,5)
    d = -0.4 - 0.5  # D[5,6): parent C[4,5)
    out = tree_credit([-1, 0, 0, 2, -1], [0, 2, 4, 5, 0], [6, 5, 7, 6, 3], [1.0, 0.0, 1.0, 0.0, 0.0])
    adv = out.advantages
    assert adv.shape == (5, 7)
    assert adv[0, :6].tolist() == pytest.approx([a0, a0, a1, a1, a2, a2], abs=1e-6)
    assert adv[1, :5].tolist() == pytest.approx([a0, a0, b, b, b], abs=1e-6)
    assert adv[2].tolist() == pytest.approx([a0, a0, a1, a1, c1, c2, c2], abs=1e-6)
    assert adv[3, :6].tolist() == pytest.approx([a0, a0, a1, a1, c1, d], abs=1e-6)
    assert adv[4, :3].tolist() == pytest.approx([-0.8] * 3, abs=1e-6)
    assert adv[0, 6] == 0 and adv[4, 3:].abs().sum() == 0  # past a row's length: 0
    assert out.rows_through[3].tolist() == [4, 4, 3, 3, 2, 1, 0]
    assert out.node_values[2].tolist() == pytest.approx([0.5, 0.5, 2 / 3, 2 / 3, 0.5, 1, 1], abs=1e-6)
    assert out.root_value == pytest.approx(0.4)


def test_branch_of_a_branch_at_an_earlier_position():
    # A root (r 1, 5 tokens); B = A@3 (r 0, 6); C = B@1 (r 1, 4): C's token 0 is A's, via B. V(root) = 2/3.
    # A[0,1) {A,B,C} V 2/3 -> 0; A[1,3) {A,B} V .5 -> 2·(.5 − 2/3)/√2; A[3,5) {A} V 1 -> 1/3 + 1/2;
    # B[3,6) {B} V 0 -> −2/3 − 1/2; C[1,4) {C} V 1 (parent A[0,1)) -> 1/3 + 1/3
    adv = tree_credit([-1, 0, 1], [0, 3, 1], [5, 6, 4], [1.0, 0.0, 1.0]).advantages
    m = 2 * (0.5 - 2 / 3) / S2
    assert adv[0, :5].tolist() == pytest.approx([0, m, m, 5 / 6, 5 / 6], abs=1e-6)
    assert adv[1].tolist() == pytest.approx([0, m, m, -7 / 6, -7 / 6, -7 / 6], abs=1e-6)
    assert adv[2, :4].tolist() == pytest.approx([0, 2 / 3, 2 / 3, 2 / 3], abs=1e-6)


def trl_centred(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """TRL 1.16's GRPO advantage with scale_rewards='none' (grpo_trainer.py: rewards − nanmean of the group)."""
    mean = torch.nanmean(rewards.view(-1, n), dim=1).repeat_interleave(n, dim=0)
    return rewards - mean


def test_no_branch_reduces_to_grpo():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    lengths = [3, 1, 4, 2, 4]
    out = tree_credit([-1] * 5, [0] * 5, lengths, r).advantages
    centred = trl_centred(r, 5)  # [.4, −.6, −.6, .4, .4]
    for i, n in enumerate(lengths):
        assert out[i, :n].tolist() == pytest.approx([2 * float(centred[i])] * n, abs=1e-6)
    exact = tree_credit([-1] * 5, [0] * 5, lengths, r, weights=(1.0, 0.0)).advantages
    for i, n in enumerate(lengths):
        assert exact[i, :n].tolist() == pytest.approx([float(centred[i])] * n, abs=1e-7)


def test_scale_off_and_weights():
    # one root (r 1), a branch at 2 (r 0): tokens [0,2) held by both, V .5 = V(root) -> 0 either way;
    # A[2,4): 1·(1 − .5) + 3·(1 − .5) = 2 (one row: scaling changes nothing); B[2,3): −2
    out = tree_credit([-1, 0], [0, 2], [4, 3], [1.0, 0.0], weights=(1.0, 3.0), scale="none").advantages
    assert out[0].tolist() == pytest.approx([0, 0, 2, 2])
    assert out[1, :3].tolist() == pytest.approx([0, 0, -2])
    # A root r 1 and two branches at 1 (r 0, r 0): A[0,1) {3 rows} V 1/3 = V(root) -> 0;
    # A[1,..) V 1: (2/3 + 2/3) = 4/3 (not scaled) ; with sqrt_rows A[0,1) stays 0
    out = tree_credit([-1, 0, 0], [0, 1, 1], [2, 2, 2], [1.0, 0.0, 0.0], scale="none").advantages
    assert out[0].tolist() == pytest.approx([0, 4 / 3])


def random_tree(rng: random.Random, rows: int):
    parents, pos, lengths = [], [], []
    for i in range(rows):
        n = rng.randint(1, 12)
        if i and rng.random() < 0.7:
            p = rng.randrange(i)
            parents.append(p)
            b = rng.randint(0, lengths[p])
            pos.append(b)
            lengths.append(b + rng.randint(0, 8))
        else:
            parents.append(-1)
            pos.append(0)
            lengths.append(n)
    return parents, pos, lengths


def test_shared_tokens_get_one_value():
    rng = random.Random(0)
    for _ in range(50):
        parents, pos, lengths = random_tree(rng, rng.randint(1, 10))
        rewards = torch.tensor([rng.choice([0.0, 0.5, 1.0]) for _ in parents])
        for kw in ({}, {"weights": (0.3, 1.7)}, {"scale": "none"}):
            adv = tree_credit(parents, pos, lengths, rewards, **kw).advantages
            for i, (p, b) in enumerate(zip(parents, pos)):
                if p >= 0:
                    assert torch.equal(adv[i, :b], adv[p, :b])  # bit-identical, not only close


def test_per_turn_rewards_return_to_go():
    # one row, no branch, two turns: reward 1 at token 1 (turn 1 = tokens 0-1), reward 2 at token 3 (turn 2 = 2-3);
    # a second row, one turn, reward 0 at token 1. G row 0 = [3, 3, 2, 2], row 1 = [0, 0]; V(root) = mean(3, 0) = 1.5
    # weights (1, 0), no scaling: A = G − 1.5
    tr = torch.tensor([[0.0, 1.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    adv = tree_credit([-1, -1], [0, 0], [4, 2], token_rewards=tr, weights=(1.0, 0.0), scale="none").advantages
    assert adv[0].tolist() == pytest.approx([1.5, 1.5, 0.5, 0.5])
    assert adv[1, :2].tolist() == pytest.approx([-1.5, -1.5])
    # outcome rewards are per-turn rewards on the last token
    parents, pos, lengths = [-1, 0, 1], [0, 3, 1], [5, 6, 4]
    r = torch.tensor([1.0, 0.0, 1.0])
    tr = torch.zeros(3, 6)
    for i, n in enumerate(lengths):
        tr[i, n - 1] = r[i]
    a = tree_credit(parents, pos, lengths, r).advantages
    b = tree_credit(parents, pos, lengths, token_rewards=tr).advantages
    assert torch.allclose(a, b, atol=1e-6)


def test_bad_trees_are_refused():
    with pytest.raises(ValueError, match="cycle"):
        tree_credit([1, 0], [1, 1], [3, 3], [0.0, 1.0])
    with pytest.raises(ValueError, match="parent 5"):
        tree_credit([-1, 5], [0, 1], [3, 3], [0.0, 1.0])
    with pytest.raises(ValueError, match="branches at 4"):
        tree_credit([-1, 0], [0, 4], [3, 5], [0.0, 1.0])
    with pytest.raises(ValueError, match="exactly one"):
        tree_credit([-1], [0], [3])
    with pytest.raises(ValueError, match="scale"):
        tree_credit([-1], [0], [3], [1.0], scale="std")
    assert lineage_order([2, -1, 1]) == [1, 2, 0]


def test_runs():
    assert runs([0.5, 0.5, -1.0, -1.0, 0.5]) == [[0, 2, 0.5], [2, 4, -1.0], [4, 5, 0.5]]
    assert runs([1.0, 2.0, 3.0], 2) == [[0, 1, 1.0], [1, 2, 2.0]]
    assert runs([]) == []


def test_per_turn_rewards_with_a_branch():
    # A: turns end at 1 (reward 1) and 3 (reward 2): G = [3, 3, 2, 2]. B = A@2 (shares turn 1), its turn 2 gives −1:
    # G = [0, 0, −1, −1]. V(root) = mean(3, 0) = 1.5. Shared node [0, 2): Q = mean(3, 0) = 1.5 -> 0.
    # A[2, 4): Q = 2, parent V 1.5 -> (.5 + .5) = 1; B[2, 4): Q = −1 -> (−2.5 − 2.5) = −5
    tr = torch.tensor([[0.0, 1.0, 0.0, 2.0], [0.0, 1.0, 0.0, -1.0]])
    out = tree_credit([-1, 0], [0, 2], [4, 4], token_rewards=tr)
    assert out.advantages[0].tolist() == pytest.approx([0, 0, 1, 1])
    assert out.advantages[1].tolist() == pytest.approx([0, 0, -5, -5])
    assert out.node_values.flatten().tolist() == pytest.approx([1.5, 1.5, 2, 2, 1.5, 1.5, -1, -1])
