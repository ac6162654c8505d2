"""`reference: arpo | aepo | appo` reproduces the released implementations on fixed inputs (docs/fidelity.md).

Each test takes the numbers of one difference between our defaults and the released code, computes them through
the same functions the strategies and the loss step call, with the switch values of a config, and checks both
sides: our default and the reference preset. This file: the preset itself and the APPO items (1-5); the APPO
branch-point selection used as the oracle is written from its description in docs/fidelity.md, independently of
the code under test. ARPO / AEPO (items 6-10) and the whole loss step: test_fidelity_arpo_aepo.py.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from appo_trl.algorithms.advantages import appo_dual_group_advantages
from appo_trl.algorithms.losses import POLICY_LOSSES
from appo_trl.config import REFERENCE_PRESETS
from appo_trl.strategies import APPOStrategy
from appo_trl.trainer.loss import loss_params, per_token_kl, reduce_loss
from tests.algorithms.fidelity_helpers import _trainer, make


# ---------------------------------------------------------------------------------------------- the preset itself
@pytest.mark.parametrize("algo", ["arpo", "aepo", "appo"])
def test_reference_preset_sets_every_switch(algo):
    cfg = make(reference=algo)
    for name, value in REFERENCE_PRESETS[algo].items():
        assert getattr(cfg, name) == value, name
    assert cfg.rollout_strategy == algo
    assert cfg.vllm_importance_sampling_correction is False  # item 7: no counterpart in the released code


def test_reference_preset_refuses_an_explicit_conflict():
    with pytest.raises(ValueError, match="reference=appo sets fv_gamma"):
        make(reference="appo", fv_gamma=0.5)
    with pytest.raises(ValueError, match="rollout_strategy"):
        make(reference="arpo", rollout_strategy="appo")
    with pytest.raises(ValueError, match="reference='ppo'"):
        make(reference="ppo")


# ---------------------------------------------------------------------------------------------------------- APPO
def _item1_loss(cfg) -> float:
    """Item 1: old logp 0; row 0 logp [ln 4, ln 4, 0], A = −1 (dropped: two dual-clip tokens); row 1 zeros, A = +1."""
    logps = torch.tensor([[math.log(4), math.log(4), 0.0], [0.0, 0.0, 0.0]])
    adv = torch.tensor([[-1.0] * 3, [1.0] * 3])
    mask = torch.ones(2, 3)
    trainer = _trainer(cfg)
    out = POLICY_LOSSES[cfg.loss_mode](logps, torch.zeros(2, 3), adv, mask, **loss_params(trainer))
    per_token = out.per_token_loss * out.keep_mask
    inputs = {"num_items_in_batch": mask.sum()}
    return reduce_loss(trainer, per_token, None, mask, out.keep_mask, inputs, train=True).item()


def test_item1_future_kl_normaliser_over_kept_rows():
    assert _item1_loss(make(rollout_strategy="appo")) == pytest.approx(-1.0)  # ours: dropped tokens still counted
    assert _item1_loss(make(reference="appo")) == pytest.approx(-2.0)  # released: kept tokens only


def test_item1_kept_tokens_needs_bnpo():
    with pytest.raises(ValueError, match="loss_type=bnpo"):
        make(rollout_strategy="appo", future_kl_normalizer="kept_tokens")


def test_item1_kept_tokens_keeps_the_kl_over_the_full_mask():
    # kept policy term −2.0 (as above); KL k3 = e^1 − 2 = 0.71828 on all 6 tokens, beta 0.5 → +0.35914
    cfg = make(reference="appo", beta=0.5)
    trainer = _trainer(cfg)
    mask, keep = torch.ones(2, 3), torch.tensor([[0.0] * 3, [1.0] * 3])
    per_token = torch.tensor([[0.0] * 3, [-2.0] * 3])
    kl = per_token_kl(torch.zeros(2, 3), torch.ones(2, 3), clamp=cfg.kl_clamp)
    loss = reduce_loss(trainer, per_token, kl, mask, keep, {}, train=True)
    assert loss.item() == pytest.approx(-2.0 + 0.5 * (math.e - 2), rel=1e-6)


def test_item2_fipo_clip_metrics_at_theta_old():
    # θ = θ_old: f ≡ 1 = the lower bound of the high-only clip → the released code reports clip_lower = 100 %
    out = POLICY_LOSSES["future_kl"](torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4), torch.ones(2, 4))
    assert out.metrics["fipo_iw_clip_lower"].item() == 1.0
    assert out.metrics["fipo_iw_clip_upper"].item() == 0.0
    # post-safety factor: A < 0 and ρ = e^1.9 = 6.69 > 6 → f clamped to [0.8, 1]; raw exp(FKL) = 1 (part = 0)
    out = POLICY_LOSSES["future_kl"](
        torch.tensor([[1.9, 0.0]]), torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2)
    )
    assert out.metrics["fipo_iw_clip_lower"].item() == 1.0
    assert out.metrics["fipo_iw_raw_min"].item() == pytest.approx(1.0)


def test_item3_future_kl_clip_ratio_zero_is_no_clip_under_the_preset():
    with pytest.raises(ValueError, match="no clip"):
        make(rollout_strategy="appo", future_kl_clip_ratio=0.0)
    cfg = make(reference="appo", future_kl_clip_ratio=0.0, epsilon_high=0.28)
    params = loss_params(_trainer(cfg))
    # γ_L ≈ 1 (decay_rate huge): d = [1, 1, 1] → FKL = [3, 2, 1] → exp = [20.09, 7.389, 2.718] → f = min(·, 10)
    params["decay_rate"] = 1e12
    d = torch.ones(1, 3)
    out = POLICY_LOSSES["future_kl"](d, torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3), **params)
    f = torch.tensor([10.0, math.exp(2), math.exp(1)])
    # A = +1, ρ = e > 1 + ε_h = 1.28 → L = −(1 + f)·1.28
    assert out.per_token_loss.view(-1).tolist() == pytest.approx((-(1 + f) * 1.28).tolist(), rel=1e-5)
    assert out.metrics["fipo_iw_clip_upper"].item() == pytest.approx(1 / 3)
    assert out.metrics["fipo_iw_clip_lower"].item() == 0.0
    # with ε_f = 0.2 (ours) the same tokens get f = 1.2 everywhere
    ours = POLICY_LOSSES["future_kl"](d, torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3), decay_rate=1e12)
    assert ours.per_token_loss.view(-1).tolist() == pytest.approx([-2.2 * 1.28] * 3, rel=1e-5)


class _Tok:
    """Vocabulary of a few strings; id 5 is the special EOS."""

    vocab = ["the", " ", ".", ",", "x", "<|im_end|>", "\n", "I"]
    all_special_ids = [5]

    def __len__(self):
        return len(self.vocab)

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.vocab[i] for i in ids)


def _zscore(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean()) / (x.std(correction=0) + 1e-6)


def _released_selection(rows, B: int, gamma: float, eps: float, vocab):
    """The released code's pick for one prompt, restated: rows = [(ids, mask, H, ℓ_train, ℓ_sampler)], float32
    torch ops for FV (one decay-matrix product) and the z-scores, Python lists and a stable sort for the rest."""
    strict, fallback = [], []
    for r, (ids, mask, H, lt, ls) in enumerate(rows):
        T = len(ids)
        m = torch.tensor(mask, dtype=torch.bool)
        if not m.any():
            continue
        lr = (torch.tensor(lt) - torch.tensor(ls)) * m.float()
        dist = torch.arange(T).view(1, -1) - torch.arange(T).view(-1, 1)  # k − t
        decay = torch.where(dist >= 0, torch.tensor(gamma) ** dist.clamp(min=0).float(), torch.zeros(()))
        fv = torch.exp((lr.view(1, -1) @ decay.t()).view(-1).clamp(-20, 20)).clamp(1 - eps, 1 + eps)
        zh, zf = torch.zeros(T), torch.zeros(T)
        zh[m] = _zscore(torch.tensor(H)[m])
        zf[m] = _zscore(fv[m])
        bs = zh * zf
        for t in torch.nonzero(m).view(-1).tolist():
            if not vocab[ids[t]].strip():
                continue
            c = (float(bs[t]), r, t)
            fallback.append(c)
            if zh[t] > 0 and zf[t] > 0 and bs[t] > 0:
                strict.append(c)
    strict.sort(key=lambda c: c[0], reverse=True)
    fallback.sort(key=lambda c: c[0], reverse=True)
    picked = strict[:B]
    for c in fallback:
        if len(picked) >= B:
            break
        if (c[1], c[2]) not in {(p[1], p[2]) for p in picked}:
            picked.append(c)
    i = 0
    while picked and len(picked) < B:
        picked.append(picked[i])
        i += 1
    return [(r, t) for _, r, t in picked]


def _appo_case(seed: int, G: int = 3, N: int = 2, T: int = 12):
    rng = random.Random(seed)
    trajs = []
    for _ in range(G * N):
        length = rng.randint(4, T)
        ids = [rng.choice([0, 0, 4, 7, 1, 2, 3, 6]) for _ in range(length - 1)] + [5]
        mask = [1] * length
        for t in range(1, length - 1):  # a tool-result span (mask 0) now and then
            if rng.random() < 0.15:
                mask[t] = 0
        trajs.append(
            SimpleNamespace(
                completion_ids=ids,
                loss_mask=mask,
                logprobs=[rng.uniform(-3, 0) for _ in range(length)],
                entropies=[rng.uniform(0, 2) for _ in range(length)],
                train=[rng.uniform(-3, 0) for _ in range(length)],
            )
        )
    return trajs


class _Engine:
    def __init__(self, trajs, N):
        self.trajs, self.N, self.requests = trajs, N, []

    def rollout(self, prompt_ids, n, seed):
        return [self.trajs[g * self.N : (g + 1) * self.N] for g in range(len(prompt_ids))]

    def branch_many(self, requests, seed, resample):
        self.requests = [(self.trajs.index(t), pos) for t, pos in requests]
        return [SimpleNamespace(completion_ids=[0]) for _ in requests]

    def run(self, x):
        return x


def _strategy_picks(cfg, trajs, G, N):
    from appo_trl.algorithms.rows import pad_rows
    from appo_trl.strategies import TokenScores

    engine = _Engine(trajs, N)

    def score(flat):
        return TokenScores(logps=pad_rows([t.train for t in flat], 0.0), entropies=torch.zeros(len(flat), 1))

    trainer = SimpleNamespace(
        args=cfg, rollout_engine=engine, score_trajectories=score, processing_class_tokenizer=_Tok()
    )
    APPOStrategy(trainer).generate([[1]] * G, cfg.num_generations, seed=0, engine=engine)
    return [[(i - g * N, pos) for i, pos in engine.requests if g * N <= i < (g + 1) * N] for g in range(G)]


def test_item4_appo_branch_points_match_the_released_selection():
    G, N, n = 3, 2, 6
    kw = dict(num_generations=n, initial_rollouts=N, per_device_train_batch_size=6, max_completion_length=64)
    ref, ours = make(reference="appo", **kw), make(rollout_strategy="appo", **kw)
    assert ref.max_branches_per_rollout is None and ours.max_branches_per_rollout == 3  # explicit, not auto
    differ = 0
    for seed in range(25):
        trajs = _appo_case(seed, G, N)
        got = _strategy_picks(ref, trajs, G, N)
        for g in range(G):
            rows = [
                (t.completion_ids, t.loss_mask, t.entropies, t.train, t.logprobs) for t in trajs[g * N : (g + 1) * N]
            ]
            want = _released_selection(rows, n - N, gamma=1.0, eps=0.2, vocab=_Tok.vocab)
            assert got[g] == want, (seed, g)
        differ += sum(a != b for a, b in zip(got, _strategy_picks(ours, trajs, G, N)))
    assert differ > 10  # our defaults pick differently in most groups: the switches matter


def test_item4_null_cap_is_no_cap_and_auto_is_explicit():
    kw = dict(rollout_strategy="appo", num_generations=8, initial_rollouts=2, per_device_train_batch_size=8)
    assert make(**kw).max_branches_per_rollout == 4  # auto: ⌈6/2⌉ + 1
    assert make(**kw, max_branches_per_rollout=None).max_branches_per_rollout is None
    assert make(**kw, max_branches_per_rollout="2").max_branches_per_rollout == 2
    with pytest.raises(ValueError, match="max_branches_per_rollout"):
        make(**kw, max_branches_per_rollout="many")


def test_item5_delta_scaling_reward_noop_under_the_preset():
    def row0(cfg):
        adv = appo_dual_group_advantages(
            initial_rewards=torch.tensor([[1.0, 0.0, 0.0, 1.0]]),
            branch_rewards=torch.tensor([[1.0, 0.0]]),
            branch_rows=torch.tensor([[0, 1]]),
            branch_positions=torch.tensor([[3, 5]]),
            branch_scores=torch.tensor([[2.0, 1.0]]),
            max_length=7,
            discount=cfg.reward_scale_discount,
            m_scaling=cfg.m_scaling,
        )
        return adv[0].tolist()

    assert row0(make(reference="appo")) == pytest.approx([2, 2, 2, 2, 1, 1, 1], abs=1e-5)
    ours = [1 + 0.9**3 + 1, 1 + 0.9**2 + 1, 1 + 0.9 + 1, 3.0, 1, 1, 1]
    assert row0(make(rollout_strategy="appo")) == pytest.approx(ours, abs=1e-5)
