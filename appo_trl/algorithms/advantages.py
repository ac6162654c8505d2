"""Advantage estimators (ARPO, AEPO and APPO papers; docs/fidelity.md).

- `group_advantages`: GRPO group-relative advantages (TRL/verl style), flat (P·G,) rewards in prompt-major order.
- `appo_dual_group_advantages`: APPO's dual-group advantage with prefix credit and saliency-decayed scale,
  (P·N, T) per-token advantages for the initial rollouts.
- `entropy_aware_advantage`: AEPO's entropy-aware re-weighting of per-token advantages.
- `tree_grpo_advantages`: Tree-GRPO's outcome advantage (arXiv 2509.21240), normalised within the prompt's group
  and within each tree (one initial rollout and its expansions), exactly as AMAP-ML/Tree-GRPO releases it.
"""

from __future__ import annotations

import numpy as np
import torch

TREE_GRPO_COMBINES = ("sum", "nested")


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    scale: str = "group",
    std: str = "population",
    eps: float = 1e-4,
) -> torch.Tensor:
    """A_i = (r_i − mean_g(r)) / (std + ε) over consecutive groups of `group_size` (GRPO as in TRL and verl).

    `scale`: "group" (std of the row's group), "batch" (std of all rewards), "none" (centred only, Dr. GRPO).
    `std`: "population" (correction 0, APPO) or "unbiased" (correction 1, ARPO/verl and TRL). With "unbiased",
    a group of size 1 gets mean 0 and std 1 (verl's convention), so its advantage is its reward.
    Example: rewards [1, 0, 0, 0], G = 4, population: mean 0.25, std √0.1875 = 0.4330 → A ≈ [1.7320, −0.5773, …].

    A NaN reward (an unscorable row, as TRL marks it) is left out of every mean and std and gets advantage 0:
    rewards [1, NaN, 0, 0], G = 4, unbiased: mean 1/3, std √(1/3) → A ≈ [1.1547, 0, −0.5773, −0.5773].
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not a multiple of group_size={group_size}")
    r = rewards.float().view(-1, group_size)
    correction = 0 if std == "population" else 1
    if std not in ("population", "unbiased"):
        raise ValueError(f"std must be 'population' or 'unbiased', got {std!r}")
    if torch.isnan(r).any():
        return _nan_group_advantages(r, group_size, scale, correction, eps)
    if group_size == 1 and correction == 1:
        mean, sd = torch.zeros_like(r), torch.ones_like(r)
    else:
        mean = r.mean(-1, keepdim=True)
        sd = r.std(-1, correction=correction, keepdim=True)
    centred = r - mean
    if scale == "group":
        out = centred / (sd + eps)
    elif scale == "batch":
        out = centred / (r.std(correction=correction if r.numel() > 1 else 0) + eps)
    elif scale == "none":
        out = centred
    else:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return out.view(-1)


def nan_std(r: torch.Tensor, dim=None, correction: int = 1, keepdim: bool = False) -> torch.Tensor:
    """The std over the non-NaN entries (TRL's `nanstd` with `correction` 1); NaN where fewer than correction + 1."""
    mean = torch.nanmean(r, dim=dim, keepdim=True)
    count = (~torch.isnan(r)).sum(dim=dim, keepdim=keepdim) if dim is not None else (~torch.isnan(r)).sum()
    sq = torch.nansum((r - mean) ** 2, dim=dim, keepdim=keepdim) if dim is not None else torch.nansum((r - mean) ** 2)
    return torch.sqrt(sq / (count - correction))


def _nan_group_advantages(r, group_size, scale, correction, eps) -> torch.Tensor:
    """`group_advantages` over the non-NaN rewards of each group (a NaN row: advantage 0)."""
    if group_size == 1 and correction == 1:
        mean, sd = torch.zeros_like(r), torch.ones_like(r)
    else:
        mean = torch.nanmean(r, -1, keepdim=True)
        sd = torch.nan_to_num(nan_std(r, -1, correction, keepdim=True), nan=0.0)
    centred = r - mean
    if scale == "group":
        out = centred / (sd + eps)
    elif scale == "batch":
        out = centred / (torch.nan_to_num(nan_std(r, correction=correction), nan=0.0) + eps)
    elif scale == "none":
        out = centred
    else:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return torch.nan_to_num(out, nan=0.0).view(-1)


def _z_scores(r: torch.Tensor, eps: float) -> torch.Tensor:
    """Row-wise (r − mean)/(population std + ε); with NaN rewards over the others only (a NaN entry stays NaN)."""
    if not torch.isnan(r).any():
        return (r - r.mean(-1, keepdim=True)) / (r.std(-1, correction=0, keepdim=True) + eps)
    sd = torch.nan_to_num(nan_std(r, -1, 0, keepdim=True), nan=0.0)
    return (r - torch.nanmean(r, -1, keepdim=True)) / (sd + eps)


def appo_dual_group_advantages(
    *,
    initial_rewards: torch.Tensor,
    branch_rewards: torch.Tensor,
    branch_rows: torch.Tensor,
    branch_positions: torch.Tensor,
    branch_scores: torch.Tensor,
    lengths: torch.Tensor | None = None,
    max_length: int,
    discount: float = 0.9,
    m_scaling: str = "advantage",
    eps: float = 1e-6,
) -> torch.Tensor:
    """APPO dual-group advantage, (P·N, T) for the initial rollouts (APPO paper; docs/fidelity.md).

    Inputs per prompt p: initial rewards (P, N), branch rewards (P, B), each branch's parent row `branch_rows`
    (P, B) in [0, N), split position s_b `branch_positions` (P, B) (−1 = bare prompt: covers no token) and score
    BS_b `branch_scores` (P, B). Â_i and Â^br_b are z-scores within the initial and the branch group (population
    std + ε). With B_i(t) = {b : parent(b) = i, s_b ≥ t}:

        m_i[t] = mean_{b∈B_i(t)} (1 + w_b·δ^(s_b − t)),   w_b = clamp(BS_b / max_{b'∈batch} BS_b', 0, 1)
        A_i[t] = m_i[t]·Â_i + mean_{b∈B_i(t)} Â^br_b      if B_i(t) ≠ ∅,   else Â_i

    Non-positive scores (decision): w_b = 0 for BS_b ≤ 0 (the branch adds no scale, m = 1 from it), and every
    w_b = 0 when max BS ≤ 0, so a fallback-only batch is not scaled. `m_scaling="reward_noop"` sets m ≡ 1
    (the reference applies m to the terminal reward where it cancels). Positions t ≥ `lengths[p, i]` are 0.
    A NaN reward (an unscorable row, as TRL marks it) is in no group's mean or std: an initial row's advantage is 0,
    a branch's is in no B_i(t).
    """
    if m_scaling not in ("advantage", "reward_noop"):
        raise ValueError(f"m_scaling must be 'advantage' or 'reward_noop', got {m_scaling!r}")
    ri, rb = initial_rewards.float(), branch_rewards.float()
    P, N = ri.shape
    T = max_length
    a_i = _z_scores(ri, eps)  # (P, N)
    base = a_i.unsqueeze(-1).expand(P, N, T)
    if rb.numel() == 0:
        out = base.clone()
    else:
        dev = ri.device
        rb = rb.to(dev)
        a_b = _z_scores(rb, eps)  # (P, B)
        s, t = branch_positions.long().to(dev), torch.arange(T, device=dev)
        cover = (s.unsqueeze(-1) >= t).float()  # (P, B, T): branch b covers t (s_b ≥ t)
        if torch.isnan(a_b).any():  # an unscorable branch covers nothing
            cover = cover * (~torch.isnan(a_b)).unsqueeze(-1).float()
            a_b = torch.nan_to_num(a_b, nan=0.0)
        parent = torch.nn.functional.one_hot(branch_rows.long().to(dev).clamp(0, N - 1), N).float()  # (P, B, N)
        count = torch.einsum("pbn,pbt->pnt", parent, cover)  # |B_i(t)|
        credit = torch.einsum("pbn,pbt,pb->pnt", parent, cover, a_b)
        has = count > 0
        denom = count.clamp(min=1.0)
        if m_scaling == "advantage":
            bs = branch_scores.float().to(dev)
            top = bs.max()
            w = (bs / top).clamp(0.0, 1.0) if top > 0 else torch.zeros_like(bs)
            decay = (
                torch.tensor(discount, dtype=torch.float64, device=dev) ** (s.unsqueeze(-1) - t).clamp(min=0).double()
            )
            term = (1.0 + w.unsqueeze(-1) * decay.float()) * cover  # (P, B, T)
            m = torch.where(has, torch.einsum("pbn,pbt->pnt", parent, term) / denom, torch.ones_like(denom))
        else:
            m = torch.ones_like(denom)
        out = torch.where(has, m * base + credit / denom, base)
    out = torch.nan_to_num(out, nan=0.0)  # an unscorable initial row
    if lengths is not None:
        out = out * (torch.arange(T, device=out.device).view(1, 1, -1) < lengths.to(out.device).view(P, N, 1)).float()
    return out.reshape(P * N, T)


def entropy_aware_advantage(
    advantages: torch.Tensor,
    entropies: torch.Tensor,
    mask: torch.Tensor,
    *,
    weight: float = 0.2,
    clamp: tuple[float, float] | None = (0.0, 2.0),
) -> torch.Tensor:
    """AEPO entropy-aware advantage Ã_t = A_t·clamp(1 + a·z_t, lo, hi), z_t = (H_t − μ)/σ (AEPO paper).

    μ and σ (unbiased std, as `Tensor.std()` in the reference; σ := 1 when 0 or undefined) are taken over the
    masked tokens of the whole tensor passed in, so the caller decides the scope (micro-batch = reference,
    mini-batch = recommended). `advantages` is (B, T) or (B,) (broadcast over T); entropies are detached.
    `clamp=None` reproduces the reference (no clamp: z < −1/a flips the sign); the default clamps to [0, 2].
    Example: H = [1, 3] valid, a = 0.2 → μ = 2, σ = √2, z = ∓0.7071 → factors 0.8586, 1.1414.
    """
    h = entropies.detach().float()
    m = mask.bool()
    vals = h[m]
    mu = vals.mean() if vals.numel() else h.new_tensor(0.0)
    sd = vals.std() if vals.numel() > 1 else h.new_tensor(0.0)
    sd = torch.where(torch.isfinite(sd) & (sd > 0), sd, torch.ones_like(sd))
    factor = 1.0 + weight * (h - mu) / sd
    if clamp is not None:
        factor = factor.clamp(*clamp)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    return adv * factor.to(adv.dtype)


def tree_grpo_advantages(rewards, groups, trees, *, combine: str = "sum", eps: float = 1e-6) -> torch.Tensor:
    """Tree-GRPO's per-row advantage (AMAP-ML/Tree-GRPO, `verl/trainer/ppo`; docs/fidelity.md), (B,).

    With z_ids(x)_i = (x_i − mean_{j: id_j = id_i} x_j) / (std_{j: id_j = id_i}(x_j) + ε), the unbiased std, and a
    set of one row taking mean 0 and std 1 (so z = x/(1 + ε)):
    `sum`: z_groups(r) + z_trees(r), the released scripts' estimator (`algorithm.adv_estimator=tree`: the
    inter-tree and intra-tree advantages added); `nested`: z_trees(z_groups(r)), the released
    `compute_tree_grpo_outcome_advantage` (`adv_estimator=tree_2norm`).

    Args:
        rewards: (B,) one outcome score per row. groups: (B,) the row's prompt group id. trees: (B,) its tree id
            (ids need only be unique per set, across the whole batch).
    Example: one group, trees {0, 1} of rewards [1, 0] and [1, 1]: z_group = [0.5, −1.5, 0.5, 0.5] (mean 0.75,
    std 0.5); `sum` adds z_tree = [0.7071, −0.7071, 0, 0] → [1.2071, −2.2071, 0.5, 0.5].
    """
    if combine not in TREE_GRPO_COMBINES:
        raise ValueError(f"tree_grpo: combine must be one of {TREE_GRPO_COMBINES}, got {combine!r}")
    r = rewards.detach().cpu().double().numpy() if isinstance(rewards, torch.Tensor) else np.asarray(rewards, float)
    g, t = np.asarray(groups).reshape(-1), np.asarray(trees).reshape(-1)
    if not r.shape == g.shape == t.shape:
        raise ValueError(f"tree_grpo: {r.size} rewards, {g.size} group ids, {t.size} tree ids")
    inter = _z_by(r.reshape(-1), g, eps)
    out = inter + _z_by(r.reshape(-1), t, eps) if combine == "sum" else _z_by(inter, t, eps)
    return torch.from_numpy(out).float()


def _z_by(x: np.ndarray, ids: np.ndarray, eps: float) -> np.ndarray:
    """(x − mean)/(unbiased std + ε) within each id's rows; an id of one row: mean 0, std 1."""
    _, inv, n = np.unique(ids, return_inverse=True, return_counts=True)
    mean = np.bincount(inv, weights=x) / n
    var = np.bincount(inv, weights=(x - mean[inv]) ** 2) / np.maximum(n - 1, 1)
    single = n == 1
    mean, std = np.where(single, 0.0, mean), np.where(single, 1.0, np.sqrt(var))
    return (x - mean[inv]) / (std[inv] + eps)
