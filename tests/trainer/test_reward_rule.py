"""TRL's reward rule on every path with its own advantages: a row for which every reward function returned None is
unscorable, its reward NaN and its advantage 0, and it moves no group's baseline (TRL 1.16 `grpo_trainer.py`,
"A completion for which every reward function returned None is unscorable"). One real training step each under
tree credit, APPO's dual groups and a `reference:` preset; the estimators' NaN rules on hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from tests.trainer.fakes import ScriptedEngine
from tests.trainer.test_reference_presets import REF_CPU
from tests.trainer.test_trainer import CPU, make_trainer


class HalfNone:
    """A reward function that scores every other row (its local index odd: None, so unscorable)."""

    __name__ = "half_none"

    def __call__(self, completions, **kw):
        return [None if i % 2 else 1.0 + 0.25 * (i % 4) + 0.1 * i for i in range(len(completions))]


def scored_round(tmp_path, tokenizer, model_path, monkeypatch, **kw):
    """One training step; the round's rows, rewards (as the strategy got them) and final advantages."""
    import appo_trl.trainer.rounds as rounds

    seen = []
    monkeypatch.setattr(rounds, "dump_round", lambda t, inputs, batch, rewards, out: seen.append(
        (batch, rewards.detach().clone(), out["advantages"].detach().clone())))  # fmt: skip
    trainer = make_trainer(tmp_path, tokenizer, model_path, ScriptedEngine(tokenizer), HalfNone(), tools=["python"],
                           max_completion_length=64, max_steps=1, dump_rollouts=1, **kw)  # fmt: skip
    trainer.train()
    assert seen
    return seen


def naive_tree_credit(group, rewards: list[float]) -> list[list[float]]:
    """TreeRL's advantages (w = (1, 1), 1/sqrt scaling) over the rows with a finite reward; 0 for the others."""
    uid = {t.uid: i for i, t in enumerate(group)}
    par = [uid.get(t.parent, -1) if t.parent is not None else -1 for t in group]
    bp, L = [t.branch_pos or 0 for t in group], [len(t.completion_ids) for t in group]
    ok = [j for j, r in enumerate(rewards) if not math.isnan(r)]

    def canon(i, t):  # the highest row of i's lineage holding its token t
        while par[i] >= 0 and t < bp[i]:
            i = par[i]
        return i

    def holders(i, t):
        return frozenset(j for j in ok if t < L[j] and canon(j, t) == canon(i, t))

    mean = lambda s: sum(rewards[j] for j in s) / len(s)  # noqa: E731
    root = mean(ok)
    out = []
    for i in range(len(group)):
        adv = []
        for t in range(L[i] if i in ok else 0):
            s, u = holders(i, t), t
            while u > 0 and holders(i, u - 1) == s:  # back to the node's first token
                u -= 1
            v_parent = mean(holders(i, u - 1)) if u > 0 else root
            adv.append(((mean(s) - root) + (mean(s) - v_parent)) / math.sqrt(len(s)))
        out.append(adv if i in ok else [0.0] * L[i])
    return out


CASES = {
    "appo_tree": dict(CPU, rollout_strategy="appo", advantage_estimator="tree", initial_rollouts=2, num_generations=4,
                      per_device_train_batch_size=4, min_remaining_tokens=4),
    "appo_dual_groups": dict(CPU, rollout_strategy="appo", initial_rollouts=2, num_generations=4,
                             per_device_train_batch_size=4, min_remaining_tokens=4),
    "reference_arpo": dict(REF_CPU, reference="arpo", initial_rollouts=2, num_generations=4,
                           per_device_train_batch_size=4),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_unscorable_rows_get_advantage_zero(case, tmp_path, tiny_tokenizer, tiny_model_path, monkeypatch):
    for batch, rewards, adv in scored_round(tmp_path, tiny_tokenizer, tiny_model_path, monkeypatch, **CASES[case]):
        unscorable = [i % 2 == 1 for i in range(len(rewards))]
        adv = adv if adv.dim() == 2 else adv.unsqueeze(1)
        for i, gone in enumerate(unscorable):
            if gone:
                assert torch.all(adv[i] == 0), f"{case}: unscorable row {i} has advantage {adv[i].tolist()[:4]}"
        assert [math.isnan(r) for r in rewards.tolist()] == unscorable, "the strategy sees NaN for unscorable rows"
        assert torch.isfinite(adv).all()
        n = len(batch.groups[0])
        if case == "appo_tree":  # the tree's baselines over the scorable rows only, recomputed naively
            assert any(r.parent is not None and r.branch_pos for r in batch.rows), "token credit over a real tree"
            for g, group in enumerate(batch.groups):
                want = naive_tree_credit(group, rewards[g * n : (g + 1) * n].tolist())
                for i, row in enumerate(want):
                    assert adv[g * n + i, : len(row)].tolist() == pytest.approx(row, abs=1e-5)
        if case == "reference_arpo":  # the group baseline over the scorable rows only (advantage_std_eps path)
            eps = 1e-6
            for g in range(len(rewards) // n):
                r = rewards[g * n : (g + 1) * n]
                ok = r[~torch.isnan(r)].double()
                want = (ok - ok.mean()) / (ok.std(correction=1) + eps)
                got = adv[g * n : (g + 1) * n, 0][~torch.isnan(r)].double()
                assert got.tolist() == pytest.approx(want.tolist(), abs=1e-5)


def test_group_advantages_leave_nan_rows_out_by_hand():
    from appo_trl.algorithms.advantages import group_advantages

    # scorable [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3) = 0.57735 -> (2/3)/0.57735 = 1.1547, (-1/3)/0.57735
    got = group_advantages(torch.tensor([1.0, math.nan, 0.0, 0.0]), 4, std="unbiased", eps=0.0)
    assert got.tolist() == pytest.approx([1.1547005, 0.0, -0.5773503, -0.5773503], abs=1e-6)
    # a group with one scorable row: mean = its reward, std 0 -> 0; a group of NaN only -> 0
    got = group_advantages(torch.tensor([2.0, math.nan, math.nan, math.nan]), 2, std="unbiased", eps=1e-4)
    assert got.tolist() == [0.0, 0.0, 0.0, 0.0]
    plain = torch.tensor([1.0, 0.0, 0.5, 0.25])
    assert torch.equal(group_advantages(plain, 4, std="unbiased"), group_advantages(plain.clone(), 4, std="unbiased"))


def test_appo_dual_groups_leave_nan_rows_out_by_hand():
    from appo_trl.algorithms.advantages import appo_dual_group_advantages

    # initial [1, NaN, 0]: z over {1, 0}: mean 0.5, population std 0.5 -> [1, 0, -1]; branches [NaN, 1, 0] off rows
    # 0, 0, 2 at s = 1: branch 0 is in no B_i(t); z over {1, 0} -> [., 1, -1]; m_scaling reward_noop (m = 1)
    out = appo_dual_group_advantages(
        initial_rewards=torch.tensor([[1.0, math.nan, 0.0]]), branch_rewards=torch.tensor([[math.nan, 1.0, 0.0]]),
        branch_rows=torch.tensor([[0, 0, 2]]), branch_positions=torch.tensor([[1, 1, 1]]),
        branch_scores=torch.ones(1, 3), max_length=3, m_scaling="reward_noop", eps=0.0,
    )  # fmt: skip
    # row 0, t <= 1: 1 + mean{1} = 2; t = 2: 1. Row 1: 0. Row 2, t <= 1: -1 + (-1) = -2; t = 2: -1
    assert out.tolist() == [[2.0, 2.0, 1.0], [0.0, 0.0, 0.0], [-2.0, -2.0, -1.0]]


def test_scorable_tree_hands_a_gone_row_to_its_latest_child():
    from appo_trl.strategies.credit import scorable_tree

    # row 0 (gone) has children 1 (at 3) and 2 (at 2): 1 takes its place, 2 branches off 1 at 2
    assert scorable_tree([-1, 0, 0], [0, 3, 2], [1, 2]) == ([-1, 0], [0, 2])
    # a gone branch row in the middle: 0 <- 1 (at 2, gone) <- 2 (at 4): 2 branches off 0 at 2
    assert scorable_tree([-1, 0, 1], [0, 2, 4], [0, 2]) == ([-1, 0], [0, 2])
    assert scorable_tree([-1, 0], [0, 2], [0, 1]) == ([-1, 0], [0, 2])


def test_tree_credit_leaves_an_unscorable_row_out_by_hand():
    from types import SimpleNamespace

    from appo_trl.strategies import Round
    from appo_trl.strategies.credit import tree_advantages
    from tests.trainer.fakes import FakeTrajectory

    rows = [FakeTrajectory([1], [5, 6], [1, 1], [-0.5] * 2, [0.1] * 2) for _ in range(3)]
    batch = Round(groups=[rows], keep=[True] * 3)
    args = SimpleNamespace(advantage_estimator="tree", tree_credit_form="paper", tree_credit_global_weight=1.0,
                           tree_credit_local_weight=1.0, tree_credit_scale="sqrt_rows")
    # three roots, rewards [1, NaN, 0]: root value 0.5; rows 0 and 2 are leaves: 2 (r - 0.5) = +-1; row 1: 0
    out = tree_advantages(batch, torch.tensor([1.0, math.nan, 0.0]), 2, args)
    assert out.tolist() == [[1.0, 1.0], [0.0, 0.0], [-1.0, -1.0]]


@pytest.mark.parametrize(
    "kw, what",
    [
        (dict(rollout_strategy="arpo", advantage_estimator="tree"), "advantage_estimator=tree"),
        (dict(rollout_strategy="grpo", advantage_std_eps=1e-6), "advantage_std_eps=1e-06"),
        (dict(rollout_strategy="appo"), "APPO's dual-group advantage"),
    ],
)
def test_normalize_then_sum_is_refused_where_the_advantages_are_our_own(kw, what, tmp_path):
    from appo_trl.config import APPOConfig

    with pytest.raises(ValueError, match=f"multi_objective_aggregation=normalize_then_sum .* but {what}") as e:
        APPOConfig(output_dir=str(tmp_path), **CPU, multi_objective_aggregation="normalize_then_sum", **kw)
    assert "\n" not in str(e.value)
    APPOConfig(output_dir=str(tmp_path), **CPU, multi_objective_aggregation="normalize_then_sum",
               rollout_strategy="arpo")  # TRL's own advantages: honoured  # fmt: skip
