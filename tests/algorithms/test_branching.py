import math

import pytest
import torch

from appo_trl.algorithms.branching import (
    branch_score_components,
    branch_scores,
    candidate_mask,
    future_value,
    is_trivial_token,
    masked_zscore,
    select_branch_points,
    strict_candidates,
)


def test_masked_zscore_hand():
    # valid [1, 2, 3] (4th masked): mean 2, pop std sqrt(2/3) = 0.816497 -> [-1.224743, 0, 1.224743, 0]
    z = masked_zscore(torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[1, 1, 1, 0]]))
    s = math.sqrt(2 / 3) + 1e-6
    assert z.view(-1).tolist() == pytest.approx([-1 / s, 0.0, 1 / s, 0.0])
    assert masked_zscore(torch.ones(1, 3), torch.zeros(1, 3)).abs().sum() == 0  # no valid -> zeros


def test_future_value_hand_and_nan():
    # γ = 0.5, diff = train - sampler = [0.1, NaN(tool), 0.2]; masked diff = [0.1, 0, 0.2]
    # S2 = 0.2, S1 = 0 + 0.5·0.2 = 0.1, S0 = 0.1 + 0.5·0.1 = 0.15 -> exp = [1.1618, 1.1052, 1.2214] -> clip 1.2
    train = torch.tensor([[0.1, -1.0, 0.2]])
    sampler = torch.tensor([[0.0, float("nan"), 0.0]])
    fv = future_value(train, sampler, torch.ones(1, 3), gamma=0.5)
    assert fv.view(-1).tolist() == pytest.approx([math.exp(0.15), math.exp(0.1), 1.2], rel=1e-6)
    # large negative drift clips at 0.8; masked tokens do not contribute
    fv = future_value(torch.tensor([[-5.0, 9.0]]), torch.zeros(1, 2), torch.tensor([[1, 0]]), gamma=1.0)
    assert fv.view(-1).tolist() == pytest.approx([0.8, 1.0])


def test_candidate_mask_rules():
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]])
    # T=6, min_remaining=2: 6-(t+1) >= 2 -> t <= 3. Last valid (EOS) t=4 excluded anyway. excluded t=1.
    excl = torch.zeros(2, 6, dtype=torch.bool)
    excl[0, 1] = True
    c = candidate_mask(mask, min_remaining=2, excluded=excl)
    assert c[0].tolist() == [True, False, True, True, False, False]
    assert not c[1].any()
    # token strings: whitespace / punctuation only tokens are excluded; max_length overrides T
    c = candidate_mask(mask[:1], token_strings=[["Hi", " ", ",", " so", "</s>"]], max_length=100, min_remaining=64)
    assert c[0].tolist() == [True, False, False, True, False, False]
    assert is_trivial_token(" \n") and is_trivial_token("...") and not is_trivial_token(" I'll")


def test_branch_scores_and_guard():
    valid = torch.ones(1, 3, dtype=torch.bool)
    H = torch.tensor([[1.0, 2.0, 3.0]])
    fv = torch.tensor([[3.0, 2.0, 1.0]])
    s = math.sqrt(2 / 3) + 1e-6
    # Z(H) = [-1/s, 0, 1/s], Z(FV) = [1/s, 0, -1/s] -> BS = [-1/s², 0, -1/s²]
    bs = branch_scores(H, fv, valid)
    assert bs.view(-1).tolist() == pytest.approx([-1 / s**2, 0.0, -1 / s**2], rel=1e-5)
    # constant FV (std 0 < 1e-4): guard sets Z(FV) := 1 -> BS = Z(H); without guard BS = 0
    flat = torch.ones(1, 3)
    assert branch_scores(H, flat, valid).view(-1).tolist() == pytest.approx([-1 / s, 0.0, 1 / s], rel=1e-5)
    assert branch_scores(H, flat, valid, degeneracy_guard=False).abs().sum() == 0
    # strict: only t=2 has Z(H)>0, Z(FV)=1>0, BS>0
    assert strict_candidates(H, flat, valid).view(-1).tolist() == [False, False, True]
    # both negative Z gives BS>0 but is not strict: H=[3,2,1], FV=[3,2,1] -> t0 has Z=+,+ ; t2 has Z=-,- (BS>0)
    bs, zh, zfv = branch_score_components(fv, fv, valid)
    assert bs[0, 2] > 0 and not strict_candidates(fv, fv, valid)[0, 2]


def test_select_strict_then_fallback_then_cap():
    # 2 rows x 4 tokens, budget 4, auto cap = ceil(4/2)+1 = 3
    scores = torch.tensor([[5.0, 4.0, 3.0, -1.0], [0.5, -2.0, -3.0, -4.0]])
    valid = torch.ones(2, 4, dtype=torch.bool)
    pts = select_branch_points(scores, valid, num_branches=4)
    # strict (BS>0) by BS: (0,0)5,(0,1)4,(0,2)3 -> row 0 hits cap 3; then (1,0)0.5 strict
    assert [(p.row, p.position, p.strict) for p in pts] == [(0, 0, True), (0, 1, True), (0, 2, True), (1, 0, True)]
    # budget 6 with cap 3 (auto would be ceil(6/2)+1 = 4): strict 4 as above, then fallback by BS with the cap:
    # (0,3) -1 blocked (row 0 at cap), then (1,1) -2, (1,2) -3
    pts = select_branch_points(scores, valid, num_branches=6, max_per_row=3)
    assert [(p.row, p.position) for p in pts][4:] == [(1, 1), (1, 2)] and not pts[4].strict
    # no cap (code-faithful): (0,3) -1 is the best fallback
    pts = select_branch_points(scores, valid, num_branches=5, max_per_row=None)
    assert (pts[4].row, pts[4].position) == (0, 3)


def test_select_cap_yields_then_duplicates():
    # one row has the only valid tokens: cap 1 yields to keep exactly 3, then duplicates of the chosen points
    scores = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    valid = torch.tensor([[True, True], [False, False]])
    pts = select_branch_points(scores, valid, num_branches=3, max_per_row=1)
    assert [(p.row, p.position) for p in pts] == [(0, 1), (0, 0), (0, 1)]
    assert [p.strict for p in pts] == [True, False, False]


def test_select_degenerate():
    scores = torch.zeros(2, 3)
    none = torch.zeros(2, 3, dtype=torch.bool)
    loss_mask = torch.tensor([[False, True, False], [False, False, False]])
    pts = select_branch_points(scores, none, num_branches=2, fallback_mask=loss_mask)
    assert [(p.row, p.position) for p in pts] == [(0, 1), (0, 1)]
    pts = select_branch_points(scores, none, num_branches=3)  # zero-length rows: bare-prompt points
    assert [(p.row, p.position) for p in pts] == [(0, -1), (1, -1), (0, -1)]
    assert select_branch_points(scores, none, num_branches=0) == []
