"""Tree credit: a group's branch tree turned into per-token advantages (TreeRL's estimator, arXiv 2506.11902).

A group is a tree. Row i leaves its parent row p(i) at completion position b(i): its tokens [0, b(i)) are the
parent's tokens at the same positions (recursively), its tokens from b(i) on are its own. A token is held by every
row that shares it through its lineage; a *node* is a maximal run of tokens held by the same rows, the *root* is the
prompt (held by the whole group), and independent rollouts share only the root.

With G_j[t] the return-to-go of row j from its token t (outcome reward: G_j[t] = r_j for every t; per-turn rewards:
the sum of the rewards placed at positions >= t, each turn's reward on that turn's last token), a token t in node n
gets

    Q_t  = mean of G_j[t] over the rows j through n          (= V(n) with outcome rewards)
    V(n) = Q at n's first token,   V(root) = mean of G_j[0] over the group (the rows' total returns)
    A_t  = (w_global·(Q_t − V(root)) + w_local·(Q_t − V(parent(n)))) / sqrt(|rows through n|)

Defaults w = (1, 1) with the 1/sqrt scaling are TreeRL's form exactly (no further std normalisation). The baseline
of each token depends only on the prompt (V(root)) and on a node already reached (V(parent(n))), never on a turn
index. A token shared by several rows is computed once, at its canonical position (the highest row of the lineage
that holds it), so every row holding it gets the same value. With no branch, every row is a leaf under the root and
A = (w_global + w_local)·(r − mean r): twice GRPO's centred advantage by default, exactly it with w = (1, 0).

Cost: one pass over the rows in lineage order plus a few gathers over the (R, T) grid: O(R·T), linear in the
group's row tokens, on the host. Pure maths: tensors (or lists) in, tensors out; the trainer's adapter builds the
inputs from trajectories. It computes in numpy (float64): its ~30 small array operations would each pay torch's
intra-op thread synchronisation, which on a busy host costs more than the work (`bench/tree_credit.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SCALES = ("sqrt_rows", "none")


@dataclass
class TreeCredit:
    """The estimator's output for one group, each (R, T), zero at t >= length.

    advantages: A_t of every row's tokens. node_values: V of the deepest node holding the token. rows_through: how
    many rows hold the token. root_value: V(root).
    """

    advantages: torch.Tensor
    node_values: torch.Tensor
    rows_through: torch.Tensor
    root_value: float


def lineage_order(parents: list[int]) -> list[int]:
    """Row indices with every parent before its children; ValueError on a parent out of range or a cycle."""
    R = len(parents)
    children: list[list[int]] = [[] for _ in range(R)]
    order = []
    for i, p in enumerate(parents):
        if p == i or not -1 <= p < R:
            raise ValueError(f"tree credit: row {i} has parent {p}; a parent is -1 (the prompt) or another row < {R}")
        if p < 0:
            order.append(i)
        else:
            children[p].append(i)
    k = 0
    while k < len(order):
        order += children[order[k]]
        k += 1
    if len(order) != R:
        raise ValueError(
            f"tree credit: the parents {parents} hold a cycle (rows {sorted(set(range(R)) - set(order))})"
        )
    return order


def tree_credit(
    parents,
    branch_pos,
    lengths,
    rewards=None,
    *,
    token_rewards: torch.Tensor | None = None,
    max_length: int | None = None,
    weights: tuple[float, float] = (1.0, 1.0),
    scale: str = "sqrt_rows",
) -> TreeCredit:
    """TreeRL's per-token advantages of one group (module docstring), (R, max_length).

    Args:
        parents: (R,) each row's parent row, -1 for a row that shares only the prompt.
        branch_pos: (R,) completion tokens copied from the parent (ignored for a root; <= both rows' lengths).
        lengths: (R,) completion tokens of each row.
        rewards: (R,) one outcome reward per row; or
        token_rewards: (R, T) per-turn rewards, each at its turn's last token (zero elsewhere).
        max_length: T of the output (default: the longest row).
        weights: (w_global, w_local).
        scale: `sqrt_rows` divides by sqrt(rows through the node), `none` does not.

    Example (outcome): one root with reward 1 and a branch off it at position 2 with reward 0, lengths 4 and 3;
    tokens [0, 2) are held by both (V = 0.5 = V(root)), the rest by one row each:
    row 0 = [0, 0, 1, 1], row 1 = [0, 0, −1] (each (r − 0.5) + (r − 0.5), over sqrt(1)).
    """
    if scale not in SCALES:
        raise ValueError(f"tree credit: scale must be one of {SCALES}, got {scale!r}")
    if (rewards is None) == (token_rewards is None):
        raise ValueError("tree credit: pass exactly one of rewards (one per row) or token_rewards (R, T)")
    par = [int(p) for p in _array(parents, np.int64).reshape(-1)]
    R = len(par)
    L = _array(lengths, np.int64).reshape(-1)
    bp = _array(branch_pos, np.int64).reshape(-1).clip(min=0)
    T = int(max_length if max_length is not None else (int(L.max()) if R else 0))
    if L.size != R or bp.size != R or (R and int(L.max()) > T):
        raise ValueError(f"tree credit: {R} parents, {L.size} lengths, {bp.size} branch positions, T={T}")
    bp = np.where(np.array(par, dtype=np.int64) < 0, 0, bp)
    order = lineage_order(par)
    for i, p in enumerate(par):
        if p >= 0 and bp[i] > min(L[i], L[p]):
            raise ValueError(
                f"tree credit: row {i} branches at {bp[i]}, past its own length {L[i]} or its parent's ({L[p]})"
            )
    pos = np.arange(T)
    valid = pos[None, :] < L[:, None]  # (R, T)
    if token_rewards is None:
        r = _array(rewards, np.float64).reshape(-1)
        G = np.broadcast_to(r[:, None], (R, T)) * valid
        total = r
    else:
        tr = _array(token_rewards, np.float64)[:, :T] * valid
        G = np.flip(np.flip(tr, 1).cumsum(1), 1)
        total = tr.sum(1)
    # canonical owner of (row, t): the highest row of the lineage that holds the token (parents first)
    owner = np.repeat(np.arange(R)[:, None], T, axis=1)
    for i in order:
        if par[i] >= 0 and bp[i] > 0:
            owner[i, : bp[i]] = owner[par[i], : bp[i]]
    flat = (owner * T + pos)[valid]
    count = np.bincount(flat, minlength=R * T).astype(np.float64).reshape(R, T)
    q = np.bincount(flat, weights=G[valid], minlength=R * T).reshape(R, T) / np.maximum(count, 1)
    # node starts on each row's own range [bp, L): its first position, and wherever the rows through it change
    own = valid & (pos[None, :] >= bp[:, None])
    changed = count != np.concatenate([np.full((R, 1), -1.0), count[:, :-1]], 1)
    boundary = own & ((pos[None, :] == bp[:, None]) | changed)
    start = np.maximum.accumulate(np.where(boundary, pos[None, :], -1), axis=1).clip(min=0)
    rows = np.arange(R)[:, None]
    node_v = q[rows, start]  # V of the node holding canonical (o, t)
    root_v = float(total.mean()) if R else 0.0
    # parent node of the node starting at s > 0 on row o: the node holding o's token s − 1 (canonical), else the root
    prev = (start - 1).clip(min=0)
    parent_v = np.where(start > 0, node_v[owner[rows, prev], prev], root_v)
    # read everything at each token's canonical position
    Q, Vn, Vp, n = q[owner, pos], node_v[owner, pos], parent_v[owner, pos], count[owner, pos]
    w_global, w_local = (float(w) for w in weights)
    adv = w_global * (Q - root_v) + w_local * (Q - Vp)
    if scale == "sqrt_rows":
        adv = adv / np.sqrt(np.maximum(n, 1))
    return TreeCredit(
        advantages=torch.from_numpy(np.where(valid, adv, 0.0)).float(),
        node_values=torch.from_numpy(np.where(valid, Vn, 0.0)).float(),
        rows_through=torch.from_numpy(np.where(valid, n, 0.0)).long(),
        root_value=root_v,
    )


def _array(x, dtype) -> np.ndarray:
    """A host numpy copy of a tensor, array or list."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


def runs(values: list[float], length: int | None = None) -> list[list]:
    """[[start, end, value], ...] covering [0, length) of a per-token list, one run per stretch of equal values."""
    values = list(values[:length] if length is not None else values)
    out: list[list] = []
    for t, x in enumerate(values):
        if out and out[-1][2] == x:
            out[-1][1] = t + 1
        else:
            out.append([t, t + 1, x])
    return out


__all__ = ["SCALES", "TreeCredit", "lineage_order", "runs", "tree_credit"]
