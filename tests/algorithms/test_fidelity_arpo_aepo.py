"""`reference: arpo | aepo` reproduces the released ARPO / AEPO code on fixed inputs (docs/fidelity.md, items 6-10).

As test_fidelity.py: each test computes one difference through the functions the strategies and the loss step
call, with our default and with the reference preset; the literal u-draw branching rules used as oracles are
written from docs/fidelity.md. Also the whole loss step (`compute_policy_loss`), reference preset against ours.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from appo_trl.algorithms import arpo as arpo_mod
from appo_trl.algorithms.advantages import entropy_aware_advantage
from appo_trl.algorithms.arpo import ARPOBranchState, PromptRoundCounter, arpo_branch_probability
from appo_trl.algorithms.entropy import segment_entropy
from appo_trl.algorithms.losses import POLICY_LOSSES
from appo_trl.strategies import ARPOStrategy, BranchHook, Round
from appo_trl.trainer.loss import loss_params, per_token_kl
from tests.algorithms.fidelity_helpers import _trainer, make


# ---------------------------------------------------------------------------------------------------------- ARPO
def test_item6_arpo_reference_loss_is_dual_clip():
    def loss_and_grad(cfg):
        lp = torch.tensor([[math.log(5.0)]], requires_grad=True)
        params = loss_params(_trainer(cfg))
        out = POLICY_LOSSES[cfg.loss_mode](lp, torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1), **params)
        out.per_token_loss.sum().backward()
        return out.per_token_loss.item(), lp.grad.item()

    assert loss_and_grad(make(reference="arpo")) == pytest.approx((3.0, 0.0))
    assert loss_and_grad(make(rollout_strategy="arpo")) == pytest.approx((5.0, 5.0))


def _literal_rule_frequency(algo: str, tau: float, beta: float, dh: float, f: float = 1.0, draws: int = 4000):
    """Share of draws u ~ U(0,1) for which the released code branches (ARPO: clip(u − βΔH) ≤ τ; AEPO:
    clip(f·(u + βΔH)) ≥ τ)."""
    rng = random.Random(7)
    hits = 0
    for _ in range(draws):
        u = rng.random()
        if algo == "arpo":
            hits += min(max(u - beta * dh, 0.0), 1.0) <= tau
        else:
            hits += min(max(f * (u + beta * dh), 0.0), 1.0) >= tau
    return hits / draws


@pytest.mark.parametrize("tau", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("dh", [-3.0, -0.5, 0.0, 1.0])
def test_item8_branch_probability_follows_the_released_rule_on_all_of_0_1(tau, dh):
    p = arpo_branch_probability(dh, base=tau, weight=0.5)
    assert p == pytest.approx(_literal_rule_frequency("arpo", tau, 0.5, dh), abs=0.03)
    for f in (1.0, 0.9, 0.0):
        p = arpo_branch_probability(dh, base=tau, weight=0.5, penalty_factor=f)
        assert p == pytest.approx(_literal_rule_frequency("aepo", tau, 0.5, dh, f), abs=0.03)


def test_item8_issue_example():
    assert arpo_branch_probability(-3.0, base=1.0, weight=0.5) == 1.0  # released: always; closed form: 0
    assert arpo_branch_probability(-3.0, base=0.0, weight=0.5, penalty_factor=1.0) == 1.0


# ---------------------------------------------------------------------------------------------------------- AEPO
def test_item9_prompt_counter_counts_refills_and_skips_empty_rounds():
    c = PromptRoundCounter()
    c.record("a", 1)  # a forks in round 1
    assert (c.counter("a", 2), c.counter("b", 2)) == (1, 0)
    c.record("a", 2)
    assert c.counter("a", 3) == 2
    # round 3: nothing created anywhere → no reset
    assert c.counter("a", 4) == 2
    c.record("b", 4)  # b refills from the bare prompt in round 4
    assert (c.counter("a", 5), c.counter("b", 5)) == (0, 1)
    state = ARPOBranchState()
    state.end_batch_round(["a", "b"], [])
    assert state.consecutive == {}  # an empty round changes nothing


def _ctx(uid, group, calls, *, parent=None, origin="root", size=2, h=0.0, root=0.0):
    traj = SimpleNamespace(uid=uid, parent=parent, group=group, num_calls=calls, origin=origin, seed=0)
    return SimpleNamespace(
        trajectory=traj,
        position=calls,
        segment_entropy=h,
        root_entropy=root,
        lookahead_entropy=None,
        group_size=size,
        target=8,
        active=1,
    )


def test_item9_hook_penalty_scope(monkeypatch):
    """Two prompts; round 1: a (prompt 0) forks a'; round 2: nobody creates; round 3: a decides again; prompt 1's
    trajectories ended in round 3 and a refill r decides its first call in round 4. P = 1 − τ/f at ΔH = 0."""
    script = iter([1, 0, 0, 0, 0, 0, 0])
    monkeypatch.setattr(arpo_mod, "sample_branch_copies", lambda prob, k, rng, slots=None: next(script))

    def run(scope):
        nonlocal script
        script = iter([1, 0, 0, 0, 0, 0, 0])
        cfg = make(rollout_strategy="aepo", aepo_penalty_scope=scope)
        hook = BranchHook(cfg, seed=0, penalty=True)
        probs = []
        for ctx in [
            _ctx("a", 0, 1),  # round 1, forks
            _ctx("c", 1, 1),  # round 1
            _ctx("a", 0, 2, size=3),  # round 2
            _ctx("a2", 0, 2, parent="a", size=3),  # the fork, round 2
            _ctx("c", 1, 2),  # round 2
            _ctx("a", 0, 3, size=3),  # round 3
            _ctx("r", 1, 1, origin="refill", size=3),  # refill created end of round 3, decides in round 4
        ]:
            before = hook.prob_sum
            hook(ctx)
            probs.append(hook.prob_sum - before)
        return probs

    f1 = 1 - 0.5 / 0.95
    # released: a's counter is 1 in rounds 2 and 3 (round 2 created nothing: no reset); the refill counts for
    # prompt 1 (l = 1 in round 4)
    assert run("prompt") == pytest.approx([0.5, 0.5, f1, f1, 0.5, f1, f1])
    # ours: per lineage; a's run is reset by its own non-forking decision, the refill starts at 0
    assert run("lineage") == pytest.approx([0.5, 0.5, f1, 0.5, 0.5, 0.5, 0.5])


def test_item10_k3_kl_clamp():
    kl = per_token_kl(torch.zeros(1, 1), torch.full((1, 1), 3.0))
    assert kl.item() == pytest.approx(math.exp(3) - 4)
    cfg = make(reference="appo")
    assert per_token_kl(torch.zeros(1, 1), torch.full((1, 1), 3.0), clamp=cfg.kl_clamp).item() == 10.0


def test_item10_empty_segment_entropy():
    assert math.isnan(segment_entropy([]))
    assert segment_entropy([], empty=0.0) == 0.0
    # ARPO hook: an empty segment after the call, H_root = 1 → released ΔH = −1, P = 0.5 − 0.2 = 0.3; ours ΔH = 0
    for cfg, want in ((make(rollout_strategy="arpo"), 0.5), (make(reference="arpo"), 0.3)):
        hook = BranchHook(cfg, seed=0, penalty=False)
        hook(_ctx("a", 0, 1, h=float("nan"), root=1.0))
        assert hook.prob_sum == pytest.approx(want)


def test_item10_group_std_eps():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    batch = Round(groups=[[0, 1], [2, 3]], keep=[True] * 4)
    default = torch.full((4,), 123.0)  # TRL's value stands in for the default path

    def adv(cfg):
        return ARPOStrategy(SimpleNamespace(args=cfg)).advantages(batch, rewards, default, 5)

    assert adv(make(rollout_strategy="arpo")) is default
    # group [1, 0]: mean 0.5, unbiased std 0.70711 → 0.5 / (0.70711 + 1e-6)
    got = adv(make(reference="arpo"))
    assert got.tolist() == pytest.approx([0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6), 0, 0])


def test_item10_aepo_strategy_alone_is_aepo_and_reference_skips_the_advantage():
    cfg = make(rollout_strategy="aepo")
    assert (cfg.entropy_balanced_advantage, cfg.loss_mode) == (True, "entropy_balanced")
    ref = make(reference="aepo")
    assert (ref.loss_mode, ref.entropy_balanced_advantage) == ("entropy_balanced", False)
    assert ref.aepo_penalty_scope == "prompt" and not ref.dynamic_rollouts
    assert make(rollout_strategy="aepo", loss_mode="clip").loss_mode == "clip"
    assert not hasattr(cfg, "initial_entropy_tokens")  # the unused 50-token probe setting is gone


def test_item10_entropy_aware_advantage_without_clamp_flips_the_sign():
    # H = [0, 0, 0, 0, 10]: μ = 2, σ = √20 = 4.472 → z₀ = −0.4472; a = 3 → 1 + 3·z₀ = −0.3416 (clamped: 0)
    h = torch.tensor([[0.0, 0.0, 0.0, 0.0, 10.0]])
    m = torch.ones(1, 5)
    a = torch.ones(1, 5)
    assert entropy_aware_advantage(a, h, m, weight=3.0, clamp=None)[0, 0].item() == pytest.approx(
        1 - 3 * 2 / math.sqrt(20), rel=1e-5
    )
    assert entropy_aware_advantage(a, h, m, weight=3.0)[0, 0].item() == 0.0


# ----------------------------------------------------------------------------- the whole loss step, reference vs ours
def _loss_step(cfg, logps, adv, *, ref_logps=None, entropies=None):
    """`compute_policy_loss` on fixed per-token logps (old logps 0) with a stand-in trainer and model forward."""
    from collections import defaultdict

    from appo_trl.trainer.loss import compute_policy_loss

    B, T = logps.shape
    ents = entropies if entropies is not None else torch.ones(B, T)
    acc = SimpleNamespace(num_processes=1, gather=lambda x: x.reshape(-1), reduce=lambda x, reduction: x)
    trainer = SimpleNamespace(
        **vars(_trainer(cfg)),
        model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list)},
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        aux_loss_enabled=False,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, ents, None),
    )
    trainer.accelerator = acc
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": torch.ones(B, T),
        "advantages": adv,
        "old_per_token_logps": torch.zeros(B, T),
        "num_items_in_batch": torch.tensor(float(B * T)),
    }
    if ref_logps is not None:
        inputs["ref_per_token_logps"] = ref_logps
    return compute_policy_loss(trainer, None, inputs).item(), trainer._metrics["train"]


def test_loss_step_reference_appo_reproduces_item1_and_item2():
    logps = torch.tensor([[math.log(4), math.log(4), 0.0], [0.0, 0.0, 0.0]])
    adv = torch.tensor([[-1.0] * 3, [1.0] * 3])
    ref, metrics = _loss_step(make(reference="appo"), logps, adv)
    ours, _ = _loss_step(make(rollout_strategy="appo"), logps, adv)
    assert (ref, ours) == (pytest.approx(-2.0), pytest.approx(-1.0))
    assert metrics["future_kl/dropped_seq_frac"] == [pytest.approx(0.5)]


def test_loss_step_reference_kl_is_clamped():
    # θ = θ_old, A = 0: the loss is beta·mean k3; ℓ_ref − ℓ_θ = 3 → k3 = 16.09 (ours) vs clamp 10 (released)
    kw = dict(beta=0.5)
    zeros, ref_lp = torch.zeros(1, 2), torch.full((1, 2), 3.0)
    ref, _ = _loss_step(make(reference="arpo", **kw), zeros, zeros, ref_logps=ref_lp)
    ours, _ = _loss_step(make(rollout_strategy="arpo", loss_mode="dual_clip", **kw), zeros, zeros, ref_logps=ref_lp)
    assert (ref, ours) == (pytest.approx(0.5 * 10), pytest.approx(0.5 * (math.exp(3) - 4), rel=1e-6))


def test_loss_step_aepo_entropy_aware_advantage_clamp_switch():
    # A = 1 on 5 tokens, H = [0, 0, 0, 0, 10] (z₀ = −0.4472), weight 3: factor −0.342 (no clamp) vs 0 (clamp)
    h = torch.tensor([[0.0, 0.0, 0.0, 0.0, 10.0]])
    adv, zeros = torch.ones(1, 5), torch.zeros(1, 5)
    kw = dict(rollout_strategy="aepo", entropy_advantage_weight=3.0, loss_type="bnpo")
    clamped, _ = _loss_step(make(**kw), zeros, adv, entropies=h)
    raw, _ = _loss_step(make(**kw, entropy_advantage_clamp=False), zeros, adv, entropies=h)
    z = [-2 / math.sqrt(20)] * 4 + [8 / math.sqrt(20)]
    assert raw == pytest.approx(-sum(1 + 3 * v for v in z) / 5, rel=1e-5)
    assert clamped == pytest.approx(-(0 * 4 + min(1 + 3 * z[4], 2.0)) / 5, rel=1e-5)


def test_loss_step_reference_aepo_skips_the_entropy_aware_advantage():
    h = torch.tensor([[0.0, 0.0, 0.0, 0.0, 10.0]])
    adv, zeros = torch.ones(1, 5), torch.zeros(1, 5)
    ref, _ = _loss_step(make(reference="aepo", entropy_advantage_weight=3.0), zeros, adv, entropies=h)
    assert ref == pytest.approx(-1.0)  # ρ = 1: −mean(A), no entropy reweighting (the released code skips it)


@pytest.mark.parametrize("algo,tau", [("arpo", 1.0), ("aepo", 0.0)])
def test_hook_branches_always_at_the_bound_under_the_preset(algo, tau):
    # ΔH = −3, β = 0.5 (issue example): the released rule branches on every draw
    cfg = make(reference=algo, branch_probability=tau, entropy_weight=0.5, beam_size=4)
    hook = BranchHook(cfg, seed=0, penalty=algo == "aepo")
    copies = [hook(_ctx(f"t{i}", 0, 1, h=0.0, root=3.0)) for i in range(20)]
    assert copies == [3] * 20
