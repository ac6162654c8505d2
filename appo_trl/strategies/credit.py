"""Tree credit for a round: the strategy's advantage step when `advantage_estimator: tree` or `tree_grpo`.

`tree_advantages` builds each group's `GroupTree` from its trajectories and runs the pure estimator
(`appo_trl.algorithms.tree_credit`): the paper's form with the config's weights and scaling (the default), or
TreeRL's released form (`tree_credit_form: treerl_released`, selected rows = `Round.keep`, the rows that reach the
loss). It returns `(B, T)` token advantages in TRL's layout (the loss reads 2-D advantages as it does APPO's).
Per-turn rewards arrive as per-token rewards already placed on each turn's last token (`Round.token_rewards`, see
`appo_trl.trainer.turn_rewards`); without them each row's reward is its outcome. Each group's `TreeCredit` is kept
in `Round.tree_credit` for the dump. `tree_grpo` returns Tree-GRPO's `(B,)` advantages
(`appo_trl.algorithms.advantages.tree_grpo_advantages`) over the groups and their lineage trees (`lineage_roots`).

An unscorable row (reward NaN: every reward function returned None, TRL's rule) is left out of its group's tree
(`scorable_tree`: its children take its place, so the rows left share exactly the tokens they shared before) and of
Tree-GRPO's group and tree statistics, so it moves no baseline; its advantage is 0.
"""

from __future__ import annotations

import torch

from appo_trl.algorithms.advantages import tree_grpo_advantages
from appo_trl.algorithms.tree_credit import TreeCredit, tree_credit, treerl_released_credit
from appo_trl.rollout.group_tree import GroupTree, lineage_roots


def tree_advantages(rnd, rewards: torch.Tensor, length: int, args) -> torch.Tensor:
    """(B, length) advantages of the local rows of round `rnd` (groups flattened) from their rewards (B,); (B,) for
    `tree_grpo`."""
    rewards = rewards.detach().float().cpu()
    if args.advantage_estimator == "tree_grpo":
        return _tree_grpo(rnd, rewards, args)
    token_rewards = rnd.token_rewards
    released = args.tree_credit_form == "treerl_released"
    if released and token_rewards is not None:
        raise ValueError(
            "tree_credit_form=treerl_released takes one outcome reward per row (the released code has no per-turn "
            "rewards), but a reward function returned per-turn lists; return one number or use the paper form."
        )
    out = torch.zeros(len(rewards), length)
    credits, row = [], 0
    kw = dict(weights=(args.tree_credit_global_weight, args.tree_credit_local_weight), scale=args.tree_credit_scale)
    for group in rnd.groups:
        tree, k = GroupTree.of(group), len(group)
        group_rewards = rewards[row : row + k]
        keep = [i for i in range(k) if not torch.isnan(group_rewards[i])]
        parents, branch_pos = scorable_tree(list(tree.parents), list(tree.branch_pos), keep)
        lengths = [int(tree.lengths[i]) for i in keep]
        if released:
            selected = [bool(rnd.keep[row + i]) for i in keep]
            credit = treerl_released_credit(
                parents, branch_pos, lengths, group_rewards[keep], selected=selected, max_length=length
            )
        elif token_rewards is not None:
            part = token_rewards[row : row + k][keep]
            credit = tree_credit(parents, branch_pos, lengths, token_rewards=part, max_length=length, **kw)
        else:
            credit = tree_credit(parents, branch_pos, lengths, group_rewards[keep], max_length=length, **kw)
        credit = _full_credit(credit, keep, k, length)
        out[row : row + k] = credit.advantages
        credits.append(credit)
        row += k
    rnd.tree_credit = credits
    return out


def scorable_tree(parents: list[int], branch_pos: list[int], keep: list[int]) -> tuple[list[int], list[int]]:
    """(parents, branch_pos) of the rows `keep` (ascending) of a group's tree, as if the others were never sampled.

    A row left out hands its place to its child that branches latest (that child's tokens equal the row's up to its
    branch position, so it holds every token the row shared with its other children); the other children branch off
    that child at their own positions. Example: parents [-1, 0, 0], branch_pos [0, 3, 2], keep [1, 2]: row 1 becomes
    a root, row 2 branches off it at 2 -> ([-1, 0], [0, 2])."""
    par, bp = list(parents), [max(0, int(b)) for b in branch_pos]
    for u in sorted(set(range(len(par))) - set(keep)):
        children = [c for c in range(len(par)) if par[c] == u]
        if children:
            heir = max(children, key=lambda c: (bp[c], -c))
            par[heir], bp[heir] = par[u], (bp[u] if par[u] >= 0 else 0)
            for c in children:
                if c != heir:
                    par[c] = heir
        par[u] = -2  # gone
    index = {old: new for new, old in enumerate(keep)}
    return [index[par[i]] if par[i] >= 0 else -1 for i in keep], [bp[i] if par[i] >= 0 else 0 for i in keep]


def _full_credit(credit: TreeCredit, keep: list[int], k: int, length: int) -> TreeCredit:
    """The credit of the scorable rows `keep` placed back among the group's `k` rows (zeros for the others)."""
    if len(keep) == k:
        return credit
    full = [
        torch.zeros(k, length, dtype=x.dtype) for x in (credit.advantages, credit.node_values, credit.rows_through)
    ]
    for f, x in zip(full, (credit.advantages, credit.node_values, credit.rows_through)):
        f[keep] = x
    return TreeCredit(*full, root_value=credit.root_value if keep else 0.0)


def _tree_grpo(rnd, rewards: torch.Tensor, args) -> torch.Tensor:
    """Tree-GRPO over the local groups: each group its prompt, each lineage root and its branches a tree; the
    unscorable rows (NaN) are in no group or tree statistic and get 0."""
    groups, trees, row = [], [], 0
    for g, group in enumerate(rnd.groups):
        groups += [g] * len(group)
        trees += [row + r for r in lineage_roots(group)]
        row += len(group)
    ok = [i for i in range(len(rewards)) if not torch.isnan(rewards[i])]
    out = torch.zeros(len(rewards), dtype=rewards.dtype)
    if ok:
        part = tree_grpo_advantages(
            rewards[ok], [groups[i] for i in ok], [trees[i] for i in ok], combine=args.tree_grpo_combine
        )
        out[ok] = part.to(out.dtype)
    return out


__all__ = ["tree_advantages"]
