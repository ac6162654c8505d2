import math

import pytest
import torch

from appo_trl.algorithms.losses import POLICY_LOSSES, discounted_future_sum


def _grad_coeff(name, ratios, advs, **kw):
    """dL/dlogπ per token divided by −A (the coefficient F on ∇logπ), for given ratios and advantages."""
    old = torch.zeros(1, len(ratios))
    logps = torch.tensor([math.log(r) for r in ratios]).view(1, -1).requires_grad_(True)
    adv = torch.tensor(advs).view(1, -1)
    out = POLICY_LOSSES[name](logps, old, adv, torch.ones_like(adv), **kw)
    out.per_token_loss.sum().backward()
    return out, (logps.grad / -adv).view(-1).tolist()


def test_clip_values_and_gradients():
    # ρ=1.5,A=1: min(1.5, 1.2)=1.2 -> L=-1.2, F=0 ; ρ=0.5,A=-1: min(-0.5,-0.8)=-0.8 -> L=0.8, F=0
    # ρ=1.1,A=2: min(2.2, 2.2)... use ρ=1.1 inside: L=-2.2, F=ρ=1.1 ; ρ=0.5,A=1: min(0.5,0.8)=0.5 -> L=-0.5, F=0.5
    out, F = _grad_coeff("clip", [1.5, 0.5, 1.1, 0.5], [1.0, -1.0, 2.0, 1.0], eps_low=0.2, eps_high=0.2)
    assert out.per_token_loss.view(-1).tolist() == pytest.approx([-1.2, 0.8, -2.2, -0.5])
    assert F == pytest.approx([0.0, 0.0, 1.1, 0.5])
    assert out.keep_mask is None
    # low: token 2 (ρ<0.8, A<0) -> 1/4 ; high: token 1 (ρ>1.2, A>0) -> 1/4
    assert out.metrics["clip_ratio/low_mean"].item() == pytest.approx(0.25)
    assert out.metrics["clip_ratio/high_mean"].item() == pytest.approx(0.25)


def test_dual_clip():
    # ρ=5, A=-1: max(5, 1.2)=5 -> min(5, 3)=3, F=0 ; ρ=2, A=-1: max(2,1.2)=2 <3 -> L=2, F=ρ=2
    # ρ=5, A=+1: max(-5,-1.2) = -1.2 (no dual clip for A>0), F=0
    out, F = _grad_coeff("dual_clip", [5.0, 2.0, 5.0], [-1.0, -1.0, 1.0], eps_low=0.2, eps_high=0.2, clip_ratio_c=3.0)
    assert out.per_token_loss.view(-1).tolist() == pytest.approx([3.0, 2.0, -1.2])
    assert F == pytest.approx([0.0, 2.0, 0.0])
    assert out.metrics["dual_clip_frac"].item() == pytest.approx(1 / 3)


def test_entropy_balanced_gradient_table():
    # gradient-coefficient table F of entropy-balanced clipping (AEPO paper), ε=0.2:
    #   ρ=1.5, A=+1 -> upper clip, F = 1+ε_h = 1.2 (PPO would give 0); value -1.2 (same as PPO)
    #   ρ=0.5, A=-1 -> lower clip, F = 0; value 0.8
    #   ρ=1.5, A=-1 -> unclipped branch, F = ρ = 1.5; value 1.5
    #   ρ=0.5, A=+1 -> F = ρ = 0.5; value -0.5
    #   ρ=1.1, A=+2 -> F = 1.1; value -2.2
    #   ρ=4.0, A=-1 -> dual clip active (c=3): value 3, F = 0
    ratios, advs = [1.5, 0.5, 1.5, 0.5, 1.1, 4.0], [1.0, -1.0, -1.0, 1.0, 2.0, -1.0]
    out, F = _grad_coeff("entropy_balanced", ratios, advs, eps_low=0.2, eps_high=0.2, clip_ratio_c=3.0)
    assert out.per_token_loss.view(-1).tolist() == pytest.approx([-1.2, 0.8, 1.5, -0.5, -2.2, 3.0])
    assert F == pytest.approx([1.2, 0.0, 1.5, 0.5, 1.1, 0.0])
    # forward equals PPO (dual clip) exactly
    ref = POLICY_LOSSES["dual_clip"](
        torch.log(torch.tensor([ratios])),
        torch.zeros(1, 6),
        torch.tensor([advs]),
        torch.ones(1, 6),
        eps_low=0.2,
        eps_high=0.2,
        clip_ratio_c=3.0,
    )
    assert torch.allclose(out.per_token_loss.detach(), ref.per_token_loss)
    # without dual clip the last token is plain unclipped: value 4, F = 4
    out, F = _grad_coeff("entropy_balanced", [4.0], [-1.0], clip_ratio_c=None)
    assert out.per_token_loss.item() == pytest.approx(4.0) and F == pytest.approx([4.0])


def _naive_future_sum(x, gamma):
    B, T = x.shape
    out = torch.zeros_like(x)
    for t in range(T):
        for k in range(t, T):
            out[:, t] += gamma ** (k - t) * x[:, k]
    return out


@pytest.mark.parametrize("T,chunk", [(1, 128), (7, 3), (9, 3), (300, 128), (256, 128)])
def test_discounted_future_sum_matches_naive(T, chunk):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(3, T, generator=g, dtype=torch.float64)
    gamma = 2 ** (-1 / 64)
    assert torch.allclose(discounted_future_sum(x, gamma, chunk), _naive_future_sum(x, gamma), atol=1e-9)


def test_discounted_future_sum_hand():
    # x = [1, 2, 3], γ = 0.5: S2 = 3, S1 = 2 + 0.5·3 = 3.5, S0 = 1 + 0.5·3.5 = 2.75 (chunk 2 exercises the carry)
    out = discounted_future_sum(torch.tensor([[1.0, 2.0, 3.0]]), 0.5, chunk_size=2)
    assert out.tolist() == [pytest.approx([2.75, 3.5, 3.0])]


def test_future_kl_hand_computed():
    # decay_rate=1 -> γ_L = 0.5. One row, d = [0.1, 0, 0.2] (all ≤ log 3), mask all 1.
    # FKL: t2 = 0.2, t1 = 0 + 0.5·0.2 = 0.1, t0 = 0.1 + 0.5·0.1 = 0.15
    # exp: [1.16183, 1.10517, 1.22140] -> clamp [1, 1.2] (high only) -> f = [1.16183, 1.10517, 1.2]
    # A = 1 -> Ã = 1 + f = [2.16183, 2.10517, 2.2]
    # ρ = exp(d) = [1.10517, 1, 1.22140]; PPO ε_h = 0.28: no clip -> L = -Ã·ρ
    d = torch.tensor([[0.1, 0.0, 0.2]])
    logps = d.clone().requires_grad_(True)
    out = POLICY_LOSSES["future_kl"](logps, torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3), decay_rate=1.0)
    f = [math.exp(0.15), math.exp(0.1), 1.2]
    expect = [-(1 + f[i]) * math.exp(d[0, i].item()) for i in range(3)]
    assert out.per_token_loss.view(-1).tolist() == pytest.approx(expect, rel=1e-5)
    out.per_token_loss.sum().backward()
    # f is detached: dL/dlogπ = -Ã·ρ (no gradient through f)
    assert logps.grad.view(-1).tolist() == pytest.approx(expect, rel=1e-5)
    assert out.keep_mask.tolist() == [[1.0, 1.0, 1.0]]
    assert out.metrics["fipo_iw_max"].item() == pytest.approx(1.2)
    assert out.metrics["fipo_iw_clip_upper"].item() == pytest.approx(1 / 3)  # exp(0.2) > 1.2 only at t2


def test_future_kl_participation_lower_clip_and_safety():
    # decay_rate=1 (γ=0.5), clip_high_only=False -> f ∈ [0.8, 1.2].
    # d = [-0.5, 2.0]: 2.0 > log 3 = 1.0986 -> part 0, so FKL = [-0.5, 0]; exp(-0.5)=0.6065 -> f0 = 0.8, f1 = 1.0
    # A = [1, -1]; ρ1 = e^2 = 7.389 > safety 6 and A<0 -> f1 clamp(1.0, 0.8, 1.0) = 1.0
    # Ã = [1·1.8, -1·2.0]; L0 = -min(1.8·ρ0, 1.8·clip(ρ0=0.6065 -> 0.8)) = -1.8·0.60653
    # L1: max(2·7.389, 2·1.28) = 14.78 -> dual clip min(14.78, 2·3) = 6
    out = POLICY_LOSSES["future_kl"](
        torch.tensor([[-0.5, 2.0]]),
        torch.zeros(1, 2),
        torch.tensor([[1.0, -1.0]]),
        torch.ones(1, 2),
        decay_rate=1.0,
        clip_high_only=False,
    )
    assert out.per_token_loss.view(-1).tolist() == pytest.approx([-1.8 * math.exp(-0.5), 6.0], rel=1e-5)
    assert out.metrics["fipo_iw_min"].item() == pytest.approx(0.8)
    assert out.metrics["fipo_iw_clip_lower"].item() == pytest.approx(0.5)
    # safety: with safety on and f from a positive FKL it would be capped at 1.0: d=[0.5, 1.9] -> part both 1?
    # 1.9 > log 3 -> part 0; FKL1=0 -> exp=1. So check a case where FKL1>0: d=[0,1.05], ρ1=2.858 > thr=2.
    # FKL1 = 1.05 -> exp 2.857 -> clamp 1.2 -> safety (A<0, ρ>2) -> clamp(1.2, 0.8, 1.0) = 1.0 -> Ã1 = -2
    out = POLICY_LOSSES["future_kl"](
        torch.tensor([[0.0, 1.05]]),
        torch.zeros(1, 2),
        torch.tensor([[1.0, -1.0]]),
        torch.ones(1, 2),
        decay_rate=1.0,
        safety_threshold=2.0,
    )
    # L1 = max(2·2.8577, 2·1.28) = 5.7154 < 6 -> 5.7154
    assert out.per_token_loss[0, 1].item() == pytest.approx(2 * math.exp(1.05), rel=1e-5)


def test_future_kl_drops_rows_with_two_dual_clip_tokens():
    # row 0: two tokens with A<0 and ρ = e^1.5 = 4.48 > 3 -> dropped; row 1: one such token -> kept;
    # row 2: two such tokens but one masked out -> kept
    lp = torch.tensor([[1.5, 1.5, 0.0], [1.5, 0.0, 0.0], [1.5, 1.5, 0.0]])
    adv = -torch.ones(3, 3)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 1], [1, 0, 1]])
    out = POLICY_LOSSES["future_kl"](lp, torch.zeros(3, 3), adv, mask)
    assert out.keep_mask.tolist() == [[0.0] * 3, [1.0] * 3, [1.0] * 3]
    assert out.metrics["dropped_seq_frac"].item() == pytest.approx(1 / 3)


def test_future_kl_empty_mask_metrics_and_zero_loss_rows():
    out = POLICY_LOSSES["future_kl"](torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert math.isnan(out.metrics["fipo_iw_min"].item()) and math.isnan(out.metrics["fipo_iw_max"].item())
    assert out.keep_mask.tolist() == [[1.0] * 3] * 2


def test_future_kl_on_policy_is_two_a():
    # θ = θ_old: d = 0 -> FKL = 0 -> f = 1 -> Ã = 2A; ρ = 1 -> L = -2A (docs/fidelity.md)
    A = torch.tensor([[0.5, -1.5, 2.0]])
    out = POLICY_LOSSES["future_kl"](torch.zeros(1, 3), torch.zeros(1, 3), A, torch.ones(1, 3))
    assert out.per_token_loss.tolist() == [pytest.approx([-1.0, 3.0, -4.0])]
