"""Tree credit as its authors released it (docs/fidelity.md, "Tree credit"): our `treerl_released_credit` against a
port of THUDM/TreeRL's released functions (`tests/algorithms/treerl_port.py`), and our `tree_grpo_advantages`
against a port of AMAP-ML/Tree-GRPO's (`tests/algorithms/tree_grpo_port.py`), on random trees within 1e-6; the
paper's form (`tree_credit`, the default) measurably apart from the released one; hand-computed cases."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from appo_trl.algorithms.advantages import tree_grpo_advantages
from appo_trl.algorithms.tree_credit import tree_credit, treerl_released_credit
from tests.algorithms import tree_grpo_port, treerl_port


def random_tree(rng: random.Random, real: bool):
    """A group as our engine makes it: roots and branches inside their parent's own tokens, at any depth, some at
    the parent's first own token (token 0 of an initial rollout) or its last; 0/1 or real rewards."""
    R = rng.randint(2, 9)
    parents, bp, L = [], [], []
    for i in range(R):
        p = -1 if i == 0 or rng.random() < 0.3 else rng.randrange(i)
        start = 0 if p < 0 else bp[p]
        if p >= 0:
            b = rng.choice([start, L[p], rng.randint(start, L[p])] + [rng.randint(start, L[p])] * 3)
        else:
            b = 0
        parents.append(p)
        bp.append(b)
        L.append(b + rng.randint(0 if p >= 0 else 1, 7))
    rewards = [rng.uniform(-1, 2) if real else float(rng.random() < 0.5) for _ in range(R)]
    return parents, bp, L, rewards


def released_gap(seed: int, real: bool) -> tuple[float, float, dict]:
    rng = random.Random(seed)
    parents, bp, L, rewards = random_tree(rng, real)
    R = len(parents)
    k = rng.randint(1, R)
    want, selected = treerl_port.released_values(parents, bp, L, rewards, num_traces=k, seed=seed)
    mask = [i in selected for i in range(R)]
    ours = treerl_released_credit(parents, bp, L, rewards, selected=mask).advantages.double()
    paper = tree_credit(parents, bp, L, rewards).advantages.double()
    gap_ours = max(max((abs(ours[i, t].item() - v) for t, v in enumerate(want[i])), default=0.0) for i in selected)
    gap_paper = max(max((abs(paper[i, t].item() - v) for t, v in enumerate(want[i])), default=0.0) for i in selected)
    for i in range(R):
        if not mask[i]:
            assert not ours[i].any(), "a row that does not reach the loss gets no value"
    return gap_ours, gap_paper, {"parents": parents, "bp": bp, "L": L, "rewards": rewards, "selected": selected}


@pytest.mark.parametrize("real", [False, True], ids=["binary", "real"])
def test_treerl_released_matches_the_port_on_random_trees(real):
    gaps = [released_gap(seed, real) for seed in range(300)]
    worst = max(range(len(gaps)), key=lambda s: gaps[s][0])
    assert gaps[worst][0] < 1e-6, f"seed {worst}: {gaps[worst][2]}"
    # the paper's form is another estimator: apart on most trees (by up to about 1 per token)
    apart = sum(g[1] > 1e-3 for g in gaps)
    assert apart > len(gaps) // 2 and max(g[1] for g in gaps) > 0.3


def test_treerl_released_hand_computed_with_a_selected_subset_and_a_fill():
    # rows: 0 root (r 1, 4 tokens); 1 = 0@2 (r 1, 3 tokens); 2 root (r 0, 2 tokens); rows 0 and 2 selected.
    # a = r − mean(others) = [0.5, 0.5, −1]. Node 0[0,2) holds rows 0, 1 (one selected): s = 1/√1/2 = 0.5;
    # s(root) = 0/√2/3 = 0. Row 0's tail [2,4): s = 0.5, local 0.5 − 0.5 = 0 → below 1e-8: takes the parent's 0.5.
    out = treerl_released_credit([-1, 0, -1], [0, 2, 0], [4, 3, 2], [1.0, 1.0, 0.0], selected=[True, False, True])
    adv = out.advantages
    assert adv[0].tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0])  # (0.5 + 0.5) on [0, 2); (0.5 filled + 0.5)
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # not selected
    assert adv[2].tolist() == pytest.approx([-2.0, -2.0, 0.0, 0.0])  # s = −1, local −1
    assert out.rows_through[0].tolist() == [2, 2, 1, 1] and out.root_value == pytest.approx(2 / 3)


def test_treerl_released_token0_branch_gets_an_empty_parent_node():
    # row 1 leaves row 0 at its token 0. Released: an empty node {0, 1} (s = (1 − 1)/√2/2 = 0) is the parent of
    # row 0's tokens and of row 1; a = [1, −1]: A = 2·a. Paper: both under the root, (r − 0.5)·2 = ±1.
    rel = treerl_released_credit([-1, 0], [0, 0], [3, 2], [1.0, 0.0]).advantages
    assert rel[0].tolist() == pytest.approx([2.0] * 3) and rel[1, :2].tolist() == pytest.approx([-2.0] * 2)
    paper = tree_credit([-1, 0], [0, 0], [3, 2], [1.0, 0.0]).advantages
    assert paper[0].tolist() == pytest.approx([1.0] * 3)
    # with a third row the empty node's value differs from the root's and reaches row 0's local term
    want, _ = treerl_port.released_values([-1, 0, -1], [0, 0, 0], [3, 2, 2], [1.0, 0.0, 0.0], 3, seed=0)
    got = treerl_released_credit([-1, 0, -1], [0, 0, 0], [3, 2, 2], [1.0, 0.0, 0.0]).advantages
    assert got[0].tolist() == pytest.approx(want[0], abs=1e-6) and got[1, :2].tolist() == pytest.approx(want[1])


def test_treerl_released_refuses_what_the_release_cannot_compute():
    with pytest.raises(ValueError, match=">= 2 rows"):
        treerl_released_credit([-1], [0], [3], [1.0])
    with pytest.raises(ValueError, match="2 rewards, 1 selected"):
        treerl_released_credit([-1, -1], [0, 0], [3, 2], [1.0, 0.0], selected=[True])


def tree_grpo_case(rng: random.Random):
    """A batch of prompt groups, each of trees of 1-4 rows (single-member groups and trees included), rewards 0/1
    or real (ties within a tree included)."""
    rewards, groups, trees, tree = [], [], [], 0
    for g in range(rng.randint(1, 4)):
        for _ in range(rng.randint(1, 3)):
            for _ in range(rng.choice([1, 1, 2, 3, 4])):
                rewards.append(rng.choice([0.0, 1.0]) if rng.random() < 0.6 else round(rng.uniform(-1, 2), 3))
                groups.append(g)
                trees.append(tree)
            tree += 1
    return torch.tensor(rewards), groups, trees


def test_tree_grpo_matches_the_released_functions_on_random_batches():
    worst = {"sum": 0.0, "nested": 0.0}
    for seed in range(400):
        r, groups, trees = tree_grpo_case(random.Random(seed))
        uid, tree_uid = [f"p{g}" for g in groups], [f"t{t}" for t in trees]  # verl's ids are strings
        for combine, port in (("sum", tree_grpo_port.released_tree),
                              ("nested", tree_grpo_port.compute_tree_grpo_outcome_advantage)):  # fmt: skip
            want = port(r.double(), uid, tree_uid)  # the released ops, in float64 (below: float32)
            got = tree_grpo_advantages(r, groups, trees, combine=combine)
            worst[combine] = max(worst[combine], (got.double() - want).abs().max().item())
    assert worst["sum"] < 1e-6 and worst["nested"] < 1e-6, worst


def test_tree_grpo_released_float32_noise_on_a_constant_tree():
    """The release runs in float32 with ε = 1e-6: a tree whose group scores are equal gets float32's rounding of
    their mean over ε (here −0.029 per row, `nested`) where the exact value, ours, is 0."""
    r = torch.tensor([1.0, 0.0, 1.0, -0.076, 1.292, 0.0, 0.0, 0.0])
    groups, trees = [0, 0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 2, 2, 3, 3, 3]
    uid, tree_uid = [str(g) for g in groups], [str(t) for t in trees]
    noisy = tree_grpo_port.compute_tree_grpo_outcome_advantage(r, uid, tree_uid)[5:]
    exact = tree_grpo_port.compute_tree_grpo_outcome_advantage(r.double(), uid, tree_uid)[5:]
    ours = tree_grpo_advantages(r, groups, trees, combine="nested")[5:]
    assert ours.abs().max() == 0 and exact.abs().max() < 1e-9 and noisy.abs().min() > 0.01


def test_tree_grpo_special_cases_by_hand():
    # a single-member group and tree: mean 0, std 1 twice → r/(1 + ε) + r/(1 + ε)
    assert tree_grpo_advantages([0.5], [0], [0]).item() == pytest.approx(1.0 / (1 + 1e-6), abs=1e-7)
    # one group of trees {0: [1, 0]}, {1: [1, 1]}: group mean 0.75, unbiased std 0.5 → [0.5, −1.5, 0.5, 0.5];
    # tree 0: mean 0.5, std 0.7071 → ±0.7071; tree 1 constant → 0 (std 0: 0/ε)
    s = tree_grpo_advantages([1.0, 0.0, 1.0, 1.0], [0] * 4, [0, 0, 1, 1])
    assert s.tolist() == pytest.approx([0.5 + 2**-0.5, -1.5 - 2**-0.5, 0.5, 0.5], abs=1e-5)
    nested = tree_grpo_advantages([1.0, 0.0, 1.0, 1.0], [0] * 4, [0, 0, 1, 1], combine="nested")
    assert nested.tolist() == pytest.approx([2**-0.5, -(2**-0.5), 0.0, 0.0], abs=1e-5)
    with pytest.raises(ValueError, match="combine must be one of"):
        tree_grpo_advantages([1.0], [0], [0], combine="mean")
    with pytest.raises(ValueError, match="2 rewards, 1 group ids"):
        tree_grpo_advantages([1.0, 0.0], [0], [0, 1])


def test_agreement_figures_printed_for_the_docs(capsys):
    """The figures docs/fidelity.md quotes: worst released-form gap and the paper form's distance (600 trees)."""
    gaps = [released_gap(seed, real) for seed in range(300) for real in (False, True)]
    ours, paper = max(g[0] for g in gaps), max(g[1] for g in gaps)
    print(f"treerl_released vs port: {ours:.2e}; paper form vs port: max {paper:.3f}, "
          f"median {float(np.median([g[1] for g in gaps])):.3f}")  # fmt: skip
    assert ours < 1e-6 < paper
