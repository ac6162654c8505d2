"""Contract fakes for `appo_trl.algorithms` pieces that have not landed yet (installed only when missing).

They follow the documented contracts (spec/algorithms.md §5.5; issue brief) closely enough to exercise the
trainer's wiring; the hand-computed maths tests belong to the algorithms layer. `install()` returns the names
of the modules it faked, so a test report shows what ran against fakes.
"""

from __future__ import annotations

import importlib
import sys
import types
from dataclasses import dataclass

import torch


@dataclass
class BranchPoint:
    row: int
    position: int
    score: float
    strict: bool = True


def _z(x, mask):
    m = mask.float()
    cnt = m.sum(-1, keepdim=True).clamp(min=1)
    mu = (x * m).sum(-1, keepdim=True) / cnt
    sd = (((x - mu) ** 2 * m).sum(-1, keepdim=True) / cnt).sqrt()
    return (x - mu) / (sd + 1e-6) * m


def future_value(train_logps, sampler_logps, mask, *, gamma):
    d = (train_logps - sampler_logps) * mask
    acc = torch.zeros_like(d[:, 0])
    out = torch.zeros_like(d)
    for t in range(d.size(1) - 1, -1, -1):
        acc = d[:, t] + gamma * acc
        out[:, t] = acc
    return out.clamp(-20, 20).exp().clamp(0.8, 1.2)


def candidate_mask(mask, *, min_remaining, excluded=None, max_length=None):
    m = mask.bool().clone()
    lengths = (max_length or mask.size(1)) - torch.arange(mask.size(1)).unsqueeze(0)
    m &= lengths > min_remaining
    if excluded is not None:
        m &= ~excluded
    return m


def branch_scores(entropy, fv, valid):
    return _z(entropy, valid) * _z(fv, valid)


def strict_candidates(entropy, fv, valid):
    return valid & (branch_scores(entropy, fv, valid) > 0)


def select_branch_points(scores, valid, *, num_branches, max_per_row, strict=None, fallback_mask=None):
    flat = scores.masked_fill(~valid, float("-inf")).flatten()
    order = torch.argsort(flat, descending=True, stable=True).tolist()
    pts, per_row = [], {}
    for idx in order:
        r, t = divmod(idx, scores.size(1))
        if len(pts) == num_branches:
            break
        if valid[r, t] and per_row.get(r, 0) < max_per_row:
            per_row[r] = per_row.get(r, 0) + 1
            pts.append(BranchPoint(r, t, float(scores[r, t]), True))
    while len(pts) < num_branches:  # fallback keeps the group at exactly n
        pts.append(BranchPoint(len(pts) % scores.size(0), 0, 0.0, False))
    return pts


def appo_dual_group_advantages(
    *,
    initial_rewards,
    branch_rewards,
    branch_rows,
    branch_positions,
    branch_scores,
    lengths,
    max_length,
    discount,
    m_scaling,
):
    G, N = initial_rewards.shape
    a_i = (initial_rewards - initial_rewards.mean(1, keepdim=True)) / (
        initial_rewards.std(1, correction=0, keepdim=True) + 1e-6
    )
    a_b = (branch_rewards - branch_rewards.mean(1, keepdim=True)) / (
        branch_rewards.std(1, correction=0, keepdim=True) + 1e-6
    )
    out = a_i.unsqueeze(-1).expand(G, N, max_length).clone()
    t = torch.arange(max_length)
    for g in range(G):
        for i in range(N):
            sel = branch_rows[g] == i
            if sel.any():
                cover = (branch_positions[g][sel].unsqueeze(-1) >= t).float()  # (b, T)
                credit = (cover * a_b[g][sel].unsqueeze(-1)).sum(0) / cover.sum(0).clamp(min=1)
                out[g, i] += credit
    return out.reshape(G * N, max_length)


def entropy_aware_advantage(advantages, entropies, mask, *, weight):
    z = _z(entropies, mask)
    return advantages * (1 + weight * z).clamp(0, 2)


@dataclass
class PolicyLossOutput:
    per_token_loss: torch.Tensor
    keep_mask: torch.Tensor | None
    metrics: dict


def _clip(logps, old, adv, mask, *, eps_low, eps_high, **_):
    ratio = torch.exp(logps - old)
    loss = -torch.min(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    return PolicyLossOutput(loss, None, {"ratio_mean": (ratio * mask).sum() / mask.sum().clamp(min=1)})


POLICY_LOSSES = {"clip": _clip, "dual_clip": _clip, "future_kl": _clip, "entropy_balanced": _clip}


def arpo_branch_probability(entropy, root_entropy, *, base, weight, penalty_factor=None):
    delta = 0.0 if entropy != entropy or root_entropy != root_entropy else entropy - root_entropy
    if penalty_factor is None:
        return min(max(base + weight * delta, 0.0), 1.0)
    return 0.0 if penalty_factor <= 0 else min(max(1 - base / penalty_factor + weight * delta, 0.0), 1.0)


def aepo_consecutive_penalty(k, rate=0.05):
    return max(0.0, 1.0 - rate * k)


def sample_branch_copies(prob, max_copies, rng):
    return sum(rng.random() < prob for _ in range(max_copies))


def aepo_initial_rollouts(root_entropy, tool_entropy, n):
    import math

    return min(max(int(n / (1 + math.exp(-0.5 * (root_entropy - tool_entropy)))) + 1, 1), n)


_MODULES = {
    "arpo": dict(
        arpo_branch_probability=arpo_branch_probability,
        aepo_consecutive_penalty=aepo_consecutive_penalty,
        sample_branch_copies=sample_branch_copies,
        aepo_initial_rollouts=aepo_initial_rollouts,
    ),
    "branching": dict(
        BranchPoint=BranchPoint,
        future_value=future_value,
        candidate_mask=candidate_mask,
        strict_candidates=strict_candidates,
        branch_scores=branch_scores,
        select_branch_points=select_branch_points,
    ),
    "advantages": dict(
        appo_dual_group_advantages=appo_dual_group_advantages, entropy_aware_advantage=entropy_aware_advantage
    ),
    "losses": dict(POLICY_LOSSES=POLICY_LOSSES, PolicyLossOutput=PolicyLossOutput),
}


def install(monkeypatch) -> list[str]:
    import appo_trl.algorithms as pkg

    faked = []
    for name, attrs in _MODULES.items():
        full = f"appo_trl.algorithms.{name}"
        try:
            importlib.import_module(full)
            continue
        except ImportError:
            pass
        mod = types.ModuleType(full)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, full, mod)
        monkeypatch.setattr(pkg, name, mod, raising=False)
        faked.append(name)
    return faked
