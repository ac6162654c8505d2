"""Per-token policy losses (verl's dual-clip PPO, AEPO paper, APPO paper / FIPO; TRL's GRPOTrainer; docs/fidelity.md).

Every loss has the same signature

    loss_fn(logps, old_logps, advantages, mask, **params) -> PolicyLossOutput

with `logps`, `old_logps`, `advantages` and `mask` all (B, T) (`mask` float or bool, 1 = token in the loss).
The functions return the **un-normalised** per-token loss, an optional per-token `keep_mask` (sequence drops)
and detached scalar metrics; the trainer multiplies by `keep_mask` and applies TRL's `loss_type` normaliser.
The ratio is ρ = exp(logπθ − logπold) throughout. `POLICY_LOSSES` maps `loss_mode` names to the functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class PolicyLossOutput:
    """Result of a policy loss: per-token loss (B, T), optional keep mask (B, T) and detached scalar metrics."""

    per_token_loss: torch.Tensor
    keep_mask: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _clip_metrics(ratio, adv, mask, eps_low, eps_high) -> dict[str, torch.Tensor]:
    """TRL-style clip fractions: low = (ρ < 1−ε_l, A < 0), high = (ρ > 1+ε_h, A > 0), region = either."""
    low = ((ratio < 1 - eps_low) & (adv < 0)).float()
    high = ((ratio > 1 + eps_high) & (adv > 0)).float()
    return {
        "clip_ratio/low_mean": _masked_mean(low, mask),
        "clip_ratio/high_mean": _masked_mean(high, mask),
        "clip_ratio/region_mean": _masked_mean(torch.maximum(low, high), mask),
    }


def _ppo(ratio, clipped_ratio, adv, clip_ratio_c):
    """max(−Aρ, −A·ρ̄) and, if `clip_ratio_c` is set, min(·, −A·c) where A < 0 (verl dual clip)."""
    loss = torch.maximum(-adv * ratio, -adv * clipped_ratio)
    if clip_ratio_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * clip_ratio_c), loss)
    return loss


def clip_loss(logps, old_logps, advantages, mask, *, eps_low: float = 0.2, eps_high: float = 0.2) -> PolicyLossOutput:
    """PPO clipped surrogate, as TRL's GRPO loss (TRL's GRPOTrainer).

    L_t = −min(ρ_t·A_t, clip(ρ_t, 1−ε_l, 1+ε_h)·A_t).
    """
    mask = mask.float()
    ratio = torch.exp(logps - old_logps)
    loss = _ppo(ratio, ratio.clamp(1 - eps_low, 1 + eps_high), advantages, None)
    with torch.no_grad():
        metrics = _clip_metrics(ratio, advantages, mask, eps_low, eps_high)
    return PolicyLossOutput(loss, None, metrics)


def dual_clip_loss(
    logps, old_logps, advantages, mask, *, eps_low: float = 0.2, eps_high: float = 0.2, clip_ratio_c: float = 3.0
) -> PolicyLossOutput:
    """Dual-clip PPO (verl's default, used by the released ARPO code; docs/fidelity.md).

    L_t = max(−A_t·ρ_t, −A_t·clip(ρ_t, 1−ε_l, 1+ε_h)); where A_t < 0: L_t = min(L_t, −A_t·c), c = `clip_ratio_c` (> 1).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    mask = mask.float()
    ratio = torch.exp(logps - old_logps)
    loss = _ppo(ratio, ratio.clamp(1 - eps_low, 1 + eps_high), advantages, clip_ratio_c)
    with torch.no_grad():
        metrics = _clip_metrics(ratio, advantages, mask, eps_low, eps_high)
        metrics["dual_clip_frac"] = _masked_mean(((advantages < 0) & (ratio > clip_ratio_c)).float(), mask)
    return PolicyLossOutput(loss, None, metrics)


def entropy_balanced_loss(
    logps,
    old_logps,
    advantages,
    mask,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
) -> PolicyLossOutput:
    """AEPO entropy clipping-balanced loss (AEPO paper); dual clip with c = `clip_ratio_c` (None disables it).

    The upper clip bound is the stop-gradient tensor (1+ε_h)·ρ/sg(ρ): its value is 1+ε_h (the forward pass equals
    PPO) but its gradient is (1+ε_h)·∇logπ. Gradient coefficient F on ∇logπ (dL/dlogπ = −A·F):
    F = 1+ε_h if (ρ > 1+ε_h and A > 0); 0 if (ρ < 1−ε_l and A < 0); ρ otherwise (and 0 where dual clip is active).
    """
    mask = mask.float()
    ratio = torch.exp(logps - old_logps)
    upper = (1 + eps_high) * ratio / ratio.detach()
    clipped = torch.where(ratio > 1 + eps_high, upper, ratio.clamp(min=1 - eps_low))
    loss = _ppo(ratio, clipped, advantages, clip_ratio_c)
    with torch.no_grad():
        metrics = _clip_metrics(ratio, advantages, mask, eps_low, eps_high)
    return PolicyLossOutput(loss, None, metrics)


def _masked_extreme(x: torch.Tensor, valid: torch.Tensor, kind: str) -> torch.Tensor:
    """min or max of `x` over `valid` entries; NaN when there is none."""
    if not bool(valid.any()):
        return x.new_tensor(float("nan"))
    return x[valid].min() if kind == "min" else x[valid].max()


_DECAY_CACHE: dict[tuple, torch.Tensor] = {}


def _decay_matrix(n: int, gamma: float, device, dtype) -> torch.Tensor:
    """D (n, n) with D[k, t] = γ^(k−t) for k ≥ t else 0, so (x @ D)[t] = Σ_{k≥t} γ^(k−t)·x_k (cached)."""
    key = (n, gamma, str(device), dtype)
    if key not in _DECAY_CACHE:
        idx = torch.arange(n, device=device, dtype=torch.float64)
        expo = idx.view(-1, 1) - idx.view(1, -1)
        d = torch.where(expo >= 0, torch.tensor(gamma, dtype=torch.float64, device=device) ** expo.clamp(min=0), 0.0)
        _DECAY_CACHE[key] = d.to(dtype)
    return _DECAY_CACHE[key]


def discounted_future_sum(x: torch.Tensor, gamma: float, chunk_size: int = 128) -> torch.Tensor:
    """S_t = Σ_{k≥t} γ^(k−t)·x_k along the last dim of (B, T) `x`, computed in chunks (future-KL of FIPO / APPO).

    The sequence is padded to a multiple of `chunk_size` C and viewed as (B, n_c, C); one matmul with the C×C decay
    matrix gives the within-chunk sums L, and the tail carried into chunk j is Σ_{i>j} γ^(C·(i−j)−t')·L_i[0],
    obtained with a second small (n_c × n_c) decay matmul: O(B·T·C) work, no Python loop over T.
    """
    B, T = x.shape
    if T == 0:
        return x.clone()
    C = min(chunk_size, T)
    n_c = -(-T // C)
    pad = n_c * C - T
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
    local = xp.view(B, n_c, C) @ _decay_matrix(C, gamma, x.device, x.dtype)  # (B, n_c, C)
    if n_c > 1:
        heads = local[:, :, 0]  # (B, n_c): full within-chunk sum from each chunk's first token
        # S at the start of chunk j: Σ_{i≥j} (γ^C)^(i−j)·heads_i; carry into chunk j is S at start of chunk j+1
        starts = heads @ _decay_matrix(n_c, gamma**C, x.device, x.dtype)
        carry = torch.nn.functional.pad(starts[:, 1:], (0, 1))  # (B, n_c)
        pos = torch.arange(C, device=x.device, dtype=x.dtype)
        tail_decay = torch.tensor(gamma, dtype=x.dtype, device=x.device) ** (C - pos)  # γ^(C−t')
        local = local + carry.unsqueeze(-1) * tail_decay
    return local.reshape(B, n_c * C)[:, :T]


def future_kl_loss(
    logps,
    old_logps,
    advantages,
    mask,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    clip_ratio_c: float = 3.0,
    decay_rate: float = 64.0,
    future_clip_ratio: float = 0.2,
    weight: float = 1.0,
    clip_high_only: bool = True,
    safety_threshold: float | None = 6.0,
    chunk_size: int = 128,
    unclipped_max: float = 10.0,
) -> PolicyLossOutput:
    """APPO's FIPO-derived `future_kl` loss (APPO paper, future-aware advantage; FIPO, arXiv 2603.19835).

    d_t = clamp(logπθ − logπold, −20, 20); part_t = 1[d_t ≤ log c];
    FKL_t = Σ_{k≥t} γ_L^(k−t)·part_k·mask_k·d_k with γ_L = 2^(−1/decay_rate) (`discounted_future_sum`, chunked);
    f_t = sg(clamp(exp(FKL_t), lo, hi)) with hi = 1+ε_f and lo = 1 if `clip_high_only` else 1−ε_f; ε_f = 0 is
    the released code's "no clip": f_t = min(exp(FKL_t), `unclipped_max` = 10), bounds (0, 10) for the metrics;
    safety: f_t = clamp(f_t, 0.8, 1.0) where A_t < 0 and ρ_t > `safety_threshold` (None disables);
    Ã_t = A_t·(1 + b·f_t), b = `weight`; L_t = dual-clip PPO with Ã (ε_l, ε_h, c).
    `keep_mask` is 0 on every sequence with more than one masked token where Ã < 0 and the dual clip is active
    (ρ > c), 1 elsewhere. Metrics (as the released code defines them): fipo_iw_{mean,min,max} of the final f;
    fipo_iw_clip_upper / _lower = share of tokens whose final (post-safety) f sits at a bound (f ≥ hi − 1e-7,
    f ≤ lo + 1e-7; so θ = θ_old with `clip_high_only` gives clip_lower = 1); fipo_iw_raw_{mean,min,max} of
    exp(FKL); dual_clip_frac; dropped_seq_frac. Example: ε_f = 0, FKL = 3 → f = min(e³, 10) = 10.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    maskf = mask.float()
    log_ratio = logps - old_logps
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        d = log_ratio.detach().clamp(-20.0, 20.0)
        part = (d <= math.log(clip_ratio_c)).to(d.dtype)
        gamma = 2.0 ** (-1.0 / decay_rate)
        fkl = discounted_future_sum(part * maskf * d, gamma, chunk_size)
        raw = torch.exp(fkl.clamp(max=20.0))
        if future_clip_ratio > 0:
            lo, hi = (1.0 if clip_high_only else 1.0 - future_clip_ratio), 1.0 + future_clip_ratio
            f = raw.clamp(lo, hi)
        else:  # the released code's "no clip"
            lo, hi = 0.0, unclipped_max
            f = raw.clamp(max=unclipped_max)
        if safety_threshold is not None:
            unsafe = (advantages < 0) & (ratio.detach() > safety_threshold)
            f = torch.where(unsafe, f.clamp(0.8, 1.0), f)
        adv = advantages * (1.0 + weight * f)
        dual_active = (adv < 0) & (ratio.detach() > clip_ratio_c) & (maskf > 0)
        keep = (dual_active.sum(-1, keepdim=True) <= 1).to(maskf.dtype).expand_as(maskf)
    loss = _ppo(ratio, ratio.clamp(1 - eps_low, 1 + eps_high), adv, clip_ratio_c)
    with torch.no_grad():
        valid = maskf > 0
        metrics = _clip_metrics(ratio, adv, maskf, eps_low, eps_high)
        metrics.update(
            {
                "fipo_iw_mean": _masked_mean(f, maskf),
                "fipo_iw_min": _masked_extreme(f, valid, "min"),  # NaN when no valid token
                "fipo_iw_max": _masked_extreme(f, valid, "max"),
                "fipo_iw_clip_upper": _masked_mean((f >= hi - 1e-7).float(), maskf),
                "fipo_iw_clip_lower": _masked_mean((f <= lo + 1e-7).float(), maskf),
                "fipo_iw_raw_mean": _masked_mean(raw, maskf),
                "fipo_iw_raw_min": _masked_extreme(raw, valid, "min"),
                "fipo_iw_raw_max": _masked_extreme(raw, valid, "max"),
                "dual_clip_frac": _masked_mean(dual_active.float(), maskf),
                "dropped_seq_frac": 1.0 - keep[:, 0].float().mean() if keep.numel() else f.new_tensor(0.0),
            }
        )
    return PolicyLossOutput(loss, keep, metrics)


# loss_mode -> loss function (same signature); the trainer picks POLICY_LOSSES[args.loss_mode]
POLICY_LOSSES: dict[str, Callable[..., PolicyLossOutput]] = {
    "clip": clip_loss,
    "dual_clip": dual_clip_loss,
    "entropy_balanced": entropy_balanced_loss,
    "future_kl": future_kl_loss,
}
