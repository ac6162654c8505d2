"""`reference: arpo | aepo | appo` reproduces the released implementations on fixed inputs (docs/fidelity.md).

Each test takes the numbers of one difference between our defaults and the released ARPO / AEPO / APPO code,
computes them through the same functions the strategies and the loss step call, with the switch values of a
config, and checks both sides: our default and the reference preset. The reference rules used as oracles here
(APPO branch-point selection, the literal u-draw branching rules) are written from their description in
docs/fidelity.md, independently of the code under test.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from appo_trl.algorithms import arpo as arpo_mod
from appo_trl.algorithms.advantages import appo_dual_group_advantages, entropy_aware_advantage
from appo_trl.algorithms.arpo import ARPOBranchState, PromptRoundCounter, arpo_branch_probability
from appo_trl.algorithms.entropy import segment_entropy
from appo_trl.algorithms.losses import POLICY_LOSSES
from appo_trl.trainer.config import REFERENCE_PRESETS, APPOConfig
from appo_trl.trainer.loss import loss_params, per_token_kl, reduce_loss
from appo_trl.trainer.strategies import APPOStrategy, ARPOStrategy, BranchHook, RoundBatch

BASE = dict(output_dir="/tmp/appo-fidelity-test", use_cpu=True, bf16=False, report_to="none", save_strategy="no")


def make(**kw) -> APPOConfig:
    return APPOConfig(**{**BASE, "num_generations": 4, "per_device_train_batch_size": 4, **kw})


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


def _trainer(cfg, ga: int = 1):
    return SimpleNamespace(
        args=cfg,
        beta=cfg.beta,
        epsilon_low=cfg.epsilon,
        epsilon_high=cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon,
        current_gradient_accumulation_steps=ga,
        accelerator=SimpleNamespace(num_processes=1),
    )


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
    from appo_trl.trainer.rows import pad_rows

    engine = _Engine(trajs, N)

    def score(flat):
        return {"logps": pad_rows([t.train for t in flat], 0.0), "entropies": torch.zeros(len(flat), 1)}

    trainer = SimpleNamespace(
        args=cfg, rollout_engine=engine, score_trajectories=score, processing_class_tokenizer=_Tok()
    )
    APPOStrategy(trainer).generate([[1]] * G, cfg.num_generations, seed=0)
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
    traj = SimpleNamespace(uid=uid, parent=parent, group=group, num_calls=calls, meta={"origin": origin, "seed": 0})
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
    batch = RoundBatch(groups=[[0, 1], [2, 3]], keep=[True] * 4)
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
