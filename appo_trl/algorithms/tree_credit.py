"""Tree credit: a group's branch tree turned into per-token advantages (TreeRL, arXiv 2506.11902).

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

`tree_credit` with w = (1, 1) and the 1/sqrt scaling is the paper's equations (no further std normalisation), not
the code TreeRL released. The baseline of each token depends only on the prompt (V(root)) and on a node already
reached (V(parent(n))), never on a turn index. A token shared by several rows is computed once, at its canonical
position (the highest row of the lineage that holds it), so every row holding it gets the same value. With no
branch, every row is a leaf under the root and A = (w_global + w_local)·(r − mean r): twice GRPO's centred
advantage by default, exactly it with w = (1, 0).

`treerl_released_credit` is the estimator of TreeRL's released code (THUDM/TreeRL: `tree_node.py`'s
`leaf_normalize`, `select_terminal`, `compute_weighted_update`; `parallel_mcts.py`'s `gather_paths` with
`use_state_value_reward` and `fill_in_paths`; the options of `scripts/treerl-qw14b.sh`). It differs from the paper's
equations in four choices and one edge case (docs/fidelity.md, "Tree credit"):
1. leave-one-out leaf values: a_i = r_i − mean of the other rows' rewards (N/(N−1)·(r_i − mean r));
2. the sqrt per node: s(n) = Σ_{i through n} a_i / sqrt(S(n)) / |rows through n|, S(n) the *selected* rows through
   n, and A_t = (s(n) − s(parent(n))) + s(n): the parent's term carries the parent's own scale;
3. a local term s(n) − s(parent(n)) below 1e-8 in magnitude (not at the root's children) takes the parent's;
4. selected leaves: S counts only the rows that reach the loss (every row, except APPO's branch rows where they are
   dropped); the mean in s(n) and the leave-one-out baseline run over all rows;
5. the empty node: a row whose child leaves at the row's own first token (a branch at token 0 of an initial
   rollout) starts with an empty node holding the row's whole subtree, parent of the row's first tokens and of
   that child (the paper's form puts such a child under the root; it shares only the prompt).

Cost: one pass over the rows in lineage order plus a few gathers over the (R, T) grid: O(R·T), linear in the
group's row tokens, on the host (the released form: one pass over its nodes, O(R² + R·T)). Pure maths: tensors (or lists) in, tensors out; the trainer's adapter builds the
inputs from trajectories. It computes in numpy (float64): its ~30 small array operations would each pay torch's
intra-op thread synchronisation, which on a busy host costs more than the work (`bench/tree_credit.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SCALES = ("sqrt_rows", "none")
FORMS = ("paper", "treerl_released")  # `tree_credit_form`: the paper's equations, TreeRL's released code
FILL_EPS = 1e-8  # fill_in_paths: a local term below this in magnitude takes the previous node's


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
    """The paper's per-token advantages of one group (module docstring), (R, max_length).

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
    par, bp, L, T, order = _tree_inputs(parents, branch_pos, lengths, max_length)
    R = len(par)
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


def treerl_released_credit(parents, branch_pos, lengths, rewards, *, selected=None, max_length=None) -> TreeCredit:
    """TreeRL's released per-token values of one group (module docstring, choices 1-5), (R, max_length).

    The value of node n is s(n) = (Σ_{i through n} a_i / sqrt(S(n))) / |rows through n| with a_i = r_i − mean of the
    other rows' rewards and S(n) the selected rows through n (unscaled where S(n) = 0); s(root) likewise over the
    group. Along every row, nodes from the root down: local(n) = s(n) − s(parent(n)), replaced by the parent's
    (filled) local term where |local(n)| < 1e-8 and the parent is not the root; A_t = local(n) + s(n) on n's tokens.

    Args:
        parents, branch_pos, lengths, max_length: as `tree_credit`. A row that leaves its parent before the
            parent's own first token (b(i) < b(p(i))) hangs on the nearest ancestor holding that token.
        rewards: (R,) one outcome reward per row (R >= 2: the baseline is the other rows' mean).
        selected: (R,) bool, the rows that reach the loss (default: all); the others get 0 (the released code
            emits no path for them) but count in every mean.

    Example: rewards [1, 0, 0], row 1 branching off row 0 at 2 (lengths 4, 3), row 2 a root (length 2), all selected:
    a = [1, −0.5, −0.5]; node [0, 2) of row 0 holds rows 0, 1: s = 0.5/√2/2 = 0.1768, s(root) = 0; row 0's tail
    s = 1, local 1 − 0.1768 → row 0 = [0.354, 0.354, 1.823, 1.823], row 1 = [0.354, 0.354, −1.177], row 2 = [−1, −1].
    """
    par, bp, L, T, order = _tree_inputs(parents, branch_pos, lengths, max_length)
    R = len(par)
    r = _array(rewards, np.float64).reshape(-1)
    sel = np.ones(R, dtype=bool) if selected is None else _array(selected, bool).reshape(-1)
    if r.size != R or sel.size != R:
        raise ValueError(f"tree credit (treerl_released): {R} rows, {r.size} rewards, {sel.size} selected flags")
    if R < 2:
        raise ValueError("tree credit (treerl_released): a group needs >= 2 rows (the leave-one-out baseline)")
    a = r - (r.sum() - r) / (R - 1)
    attach = []  # the row whose own tokens [b(p), L(p)] hold the branch point
    for i in range(R):
        p = par[i]
        while p >= 0 and bp[i] < bp[p]:
            p = par[p]
        attach.append(p)
    sub = np.stack([a, r, np.ones(R), sel.astype(np.float64)], 1)  # (Σa, Σr, rows, selected) of each subtree
    for i in reversed(order):
        if attach[i] >= 0:
            sub[attach[i]] += sub[i]
    cuts = [sorted({int(bp[j]) for j in range(R) if attach[j] == i}) for i in range(R)]

    def value(acc):  # acc = (Σa, Σr, rows, selected) of a node: its s(n)
        return (acc[0] / np.sqrt(acc[3]) if acc[3] > 0 else acc[0]) / acc[2]

    root = sub[[i for i in range(R) if attach[i] < 0]].sum(0)
    s_root = value(root)
    out, node_v, count = (np.zeros((R, T)) for _ in range(3))
    ends: dict[tuple[int, int], tuple[float, float]] = {}  # (row, end) -> (s, filled local) of its node
    for i in order:
        bounds = [int(bp[i]), *cuts[i], int(L[i])]
        acc = sub[i].copy()  # row i and every subtree hanging at or after the node's end
        tails = [np.zeros(4) for _ in bounds]
        for j in range(R):
            if attach[j] == i:
                tails[bounds.index(int(bp[j]), 1)] += sub[j]
        parent = ends[(attach[i], int(bp[i]))] if attach[i] >= 0 else None
        for k in range(len(bounds) - 1):
            s = value(acc)
            local = s - (parent[0] if parent else s_root)
            if parent and abs(local) < FILL_EPS:
                local = parent[1]
            start, end = bounds[k], bounds[k + 1]
            out[i, start:end], node_v[i, start:end], count[i, start:end] = local + s, acc[1] / acc[2], acc[2]
            parent = (s, local)
            if k + 2 < len(bounds):  # a node ending at a cut: the children there hang under it
                ends[(i, end)] = parent
            acc -= tails[k + 1]
    for i in order:  # the shared tokens: the parent's values
        if attach[i] >= 0:
            for x in (out, node_v, count):
                x[i, : bp[i]] = x[attach[i], : bp[i]]
    out[~sel] = 0.0
    return TreeCredit(
        advantages=torch.from_numpy(out).float(),
        node_values=torch.from_numpy(node_v).float(),
        rows_through=torch.from_numpy(count).long(),
        root_value=float(r.mean()),
    )


def _tree_inputs(parents, branch_pos, lengths, max_length):
    """(parents, branch positions (0 at roots), lengths, T, lineage order), checked; ValueError naming the fault."""
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
    return par, bp, L, T, order


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


__all__ = ["FORMS", "SCALES", "TreeCredit", "lineage_order", "runs", "tree_credit", "treerl_released_credit"]
