"""APPO branch-point maths (APPO paper; docs/fidelity.md).

All per-token inputs are (B, T) tensors over the initial rollouts (one row per rollout, completion tokens only),
with a float/bool `mask` of scorable tokens. The functions are pure: no trainer or rollout state.

Pipeline: `future_value` → `candidate_mask` → `branch_score_components` (or `branch_scores`) →
`select_branch_points` per prompt group.
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from appo_trl.algorithms.losses import discounted_future_sum

_TRIVIAL = string.whitespace + string.punctuation


@dataclass
class BranchPoint:
    """A selected branch point: `row` within the group's initial rollouts, completion `position` t (the branch
    prefix is `response[:t+1]` as in the released APPO code; t = −1 means the bare prompt), its score BS and
    whether it was a strict candidate (Z(H) > 0, Z(FV) > 0, BS > 0) or a fallback / duplicate."""

    row: int
    position: int
    score: float
    strict: bool = True


def masked_zscore(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per-row z-score over masked entries, Z(x) = (x − mean_v(x)) / (std_v(x, correction=0) + ε); 0 where invalid.

    APPO paper; docs/fidelity.md (population std, ε = 1e-6). A row with no valid entry is all zeros.
    Example: x = [1, 2, 3], all valid → mean 2, std √(2/3) = 0.8165 → Z ≈ [−1.2247, 0, 1.2247].
    """
    out = torch.zeros_like(x)
    m = mask.bool()
    for r in range(x.size(0)):  # the released code's exact ops, row by row (same rounding, same float noise)
        v = x[r][m[r]]
        if v.numel():
            out[r][m[r]] = (v - v.mean()) / (v.std(correction=0) + eps)
    return out


def future_value(
    train_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    clip_eps: float = 0.2,
) -> torch.Tensor:
    """FutureValue FV_t = clip(exp(clamp(Σ_{k≥t} γ^(k−t)·m_k·(ℓ^train_k − ℓ^sampler_k), −20, 20)), 1−ε, 1+ε).

    APPO paper; docs/fidelity.md (γ = `gamma`: 2^(−1/64) proposed, 1.0 code-faithful; ε = 0.2). NaN sampler
    (or trainer) logprobs — tool tokens, missing entries — count as masked. Returns (B, T); positions after a row's
    last valid token have an empty sum and get FV = 1.
    """
    m = mask.bool() & ~torch.isnan(sampler_logps) & ~torch.isnan(train_logps)
    lr = torch.where(m, train_logps - sampler_logps, torch.zeros((), dtype=train_logps.dtype))
    s = discounted_future_sum(lr.to(torch.float32 if lr.dtype in (torch.float16, torch.bfloat16) else lr.dtype), gamma)
    fv = torch.exp(s.clamp(-20.0, 20.0))
    return fv.clamp(1.0 - clip_eps, 1.0 + clip_eps) if clip_eps > 0 else fv  # ε = 0: no clip (released code)


def is_trivial_token(text: str) -> bool:
    """True for a decoded token made only of whitespace and/or ASCII punctuation (or empty): never a branch point."""
    return text.strip(_TRIVIAL) == ""


def candidate_mask(
    mask: torch.Tensor,
    *,
    min_remaining: int = 0,
    excluded: torch.Tensor | None = None,
    token_strings: Sequence[Sequence[str]] | None = None,
    exclude_last: bool = True,
    max_length: int | None = None,
) -> torch.Tensor:
    """Bool (B, T) of positions that may be branch points (APPO paper; docs/fidelity.md).

    A position t is a candidate when `mask[t]` is set, `(max_length or T) − (t+1) ≥ min_remaining` (room left for
    the continuation; pass the generation limit as `max_length`, otherwise the padded width T is used), it is not
    `excluded` (a per-token bool (B, T), e.g. whitespace/punctuation/special token ids looked up by the caller),
    its decoded text in `token_strings` (optional, row-wise lists) is not whitespace/punctuation only, and, with
    `exclude_last`, it is not the row's last valid token (the final EOS).
    """
    valid = mask.bool().clone()
    B, T = valid.shape
    limit = T if max_length is None else max_length
    pos = torch.arange(T, device=valid.device)
    valid &= (limit - (pos + 1) >= min_remaining).unsqueeze(0)
    if excluded is not None:
        valid &= ~excluded.bool()
    if token_strings is not None:
        for r, toks in enumerate(token_strings):
            for t, s in enumerate(toks[:T]):
                if is_trivial_token(s):
                    valid[r, t] = False
    if exclude_last and T:
        m = mask.bool()
        last = torch.where(m.any(-1), T - 1 - m.flip(-1).int().argmax(-1), torch.full((B,), -1, device=m.device))
        rows = torch.nonzero(last >= 0).view(-1)
        valid[rows, last[rows]] = False
    return valid


def branch_score_components(
    entropy: torch.Tensor,
    fv: torch.Tensor,
    valid: torch.Tensor,
    *,
    degeneracy_guard: bool = True,
    guard_std: float = 1e-4,
    zscore_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(BS, Z(H), Z(FV)), each (B, T) and 0 outside `valid`: BS_t = Z(H)_t·Z(FV)_t (APPO paper, branching score).

    Z is `masked_zscore` per row over `zscore_mask` (default: `valid`, the candidates; the released code uses every
    loss-mask token, candidates or not). Degeneracy guard (ours, docs/fidelity.md): a row whose FV has population
    std < `guard_std` over the z-score scope gets Z(FV) := 1 there, so BS = Z(H); the released code has no guard
    and then ranks by float noise (Z(FV) ≈ 0 everywhere).
    """
    v = valid.bool()
    scope = v if zscore_mask is None else zscore_mask.bool()
    zh = masked_zscore(entropy.float(), scope)
    zfv = masked_zscore(fv.float(), scope)
    if degeneracy_guard:
        m = scope.float()
        cnt = m.sum(-1, keepdim=True).clamp(min=1.0)
        mu = (fv.float() * m).sum(-1, keepdim=True) / cnt
        sd = ((((fv.float() - mu) * m) ** 2).sum(-1, keepdim=True) / cnt).sqrt()
        zfv = torch.where((sd < guard_std) & scope, torch.ones_like(zfv), zfv)
    return zh * zfv * v, zh, zfv


def branch_scores(entropy, fv, valid, *, degeneracy_guard: bool = True, zscore_mask=None) -> torch.Tensor:
    """BS = Z(H)·Z(FV) (B, T), 0 outside `valid`; see `branch_score_components`."""
    return branch_score_components(entropy, fv, valid, degeneracy_guard=degeneracy_guard, zscore_mask=zscore_mask)[0]


def strict_candidates(entropy, fv, valid, *, degeneracy_guard: bool = True, zscore_mask=None) -> torch.Tensor:
    """Bool (B, T): valid positions with Z(H) > 0, Z(FV) > 0 and BS > 0 (the released code's "strict" list)."""
    bs, zh, zfv = branch_score_components(
        entropy, fv, valid, degeneracy_guard=degeneracy_guard, zscore_mask=zscore_mask
    )
    return valid.bool() & (zh > 0) & (zfv > 0) & (bs > 0)


def _ranked(scores: torch.Tensor, sel: torch.Tensor) -> list[tuple[int, int, float]]:
    """(row, t, score) of the selected positions, by score descending; ties keep (row, t) order (stable)."""
    idx = torch.nonzero(sel, as_tuple=False)
    if idx.numel() == 0:
        return []
    vals = scores[sel].double()
    order = torch.argsort(-vals, stable=True).tolist()
    rows, cols, v = idx[:, 0].tolist(), idx[:, 1].tolist(), vals.tolist()
    return [(rows[i], cols[i], v[i]) for i in order]


def select_branch_points(
    scores: torch.Tensor,
    valid: torch.Tensor,
    *,
    num_branches: int,
    max_per_row: int | None | str = "auto",
    strict: torch.Tensor | None = None,
    fallback_mask: torch.Tensor | None = None,
) -> list[BranchPoint]:
    """Exactly `num_branches` branch points for one prompt, pooled over its initial rollouts (APPO paper).

    `scores`/`valid` are (N, T) for the group's N initial rows. Order of filling:
    1. strict candidates (`strict`, default `valid & scores > 0`; pass `strict_candidates(...)` for the full
       Z(H) > 0, Z(FV) > 0, BS > 0 rule) by BS descending, at most `max_per_row` per row;
    2. other valid positions by BS descending, same cap;
    3. remaining valid positions ignoring the cap (the cap only yields to keep the group at exactly n);
    4. if there is no valid position at all, positions of `fallback_mask` (e.g. the loss mask), by BS;
       if that is empty too (all rows empty), bare-prompt points (row r, position −1) cycling over rows;
    5. duplicates of the points chosen so far, cycling in selection order.
    No (row, t) repeats before step 5. `max_per_row="auto"` is ⌈num_branches/N⌉ + 1; None disables the cap
    (code-faithful). Points of steps 2–5 have `strict=False`.
    """
    N = scores.size(0)
    if num_branches <= 0 or N == 0:
        return []
    cap = math.ceil(num_branches / N) + 1 if max_per_row == "auto" else max_per_row
    v = valid.bool()
    s = strict.bool() & v if strict is not None else v & (scores > 0)
    out: list[BranchPoint] = []
    taken: set[tuple[int, int]] = set()
    per_row = [0] * N

    def fill(cands, is_strict, capped):
        for r, t, sc in cands:
            if len(out) == num_branches:
                return
            if (r, t) in taken or (capped and cap is not None and per_row[r] >= cap):
                continue
            taken.add((r, t))
            per_row[r] += 1
            out.append(BranchPoint(r, t, sc, is_strict))

    ranked_valid = _ranked(scores, v)
    fill(_ranked(scores, s), True, True)
    fill(ranked_valid, False, True)
    fill(ranked_valid, False, False)
    if not out and fallback_mask is not None:
        fill(_ranked(scores, fallback_mask.bool()), False, False)
    if not out:
        out.append(BranchPoint(0, -1, 0.0, False))
    base = list(out)
    i = 0
    while len(out) < num_branches:
        p = base[i % len(base)]
        row = len(out) % N if p.position == -1 else p.row  # spread bare-prompt points over rows
        out.append(BranchPoint(row, p.position, p.score, False))
        i += 1
    return out


def appo_branch_points(
    entropy: torch.Tensor,
    fv: torch.Tensor,
    loss_mask: torch.Tensor,
    valid: torch.Tensor,
    *,
    group_size: int,
    num_branches: int,
    zscore_scope: str = "candidates",
    degeneracy_guard: bool = True,
    max_per_row: int | None | str = "auto",
) -> tuple[list[list[BranchPoint]], torch.Tensor]:
    """APPO branch points of a batch of initial rollouts: (points per prompt group, BS (B, T)).

    Rows are grouped by `group_size` consecutive initial rollouts per prompt. `valid` are the candidate positions
    (`candidate_mask`), `loss_mask` every sampled token. `zscore_scope="candidates"` (ours) z-scores H and FV over
    the candidates; `"loss_mask"` (released code) over every loss-mask token. Each group then gets exactly
    `num_branches` points from `select_branch_points` (strict candidates, then the rest by BS, with the per-row
    `max_per_row` cap: "auto" = ⌈B/N⌉ + 1, an int, or None = no cap as in the released code).
    """
    if zscore_scope not in ("candidates", "loss_mask"):
        raise ValueError(f"zscore_scope must be 'candidates' or 'loss_mask', got {zscore_scope!r}")
    scope = loss_mask.bool() if zscore_scope == "loss_mask" else None
    bs, zh, zfv = branch_score_components(entropy, fv, valid, degeneracy_guard=degeneracy_guard, zscore_mask=scope)
    strict = valid.bool() & (zh > 0) & (zfv > 0) & (bs > 0)
    points = []
    for g in range(loss_mask.size(0) // group_size):
        sl = slice(g * group_size, (g + 1) * group_size)
        points.append(
            select_branch_points(
                bs[sl],
                valid[sl],
                num_branches=num_branches,
                max_per_row=max_per_row,
                strict=strict[sl],
                fallback_mask=loss_mask[sl].bool(),
            )
        )
    return points, bs
