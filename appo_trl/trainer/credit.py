"""Tree credit for a round: the strategy's advantage step when `advantage_estimator: tree`.

`tree_advantages` builds each group's `GroupTree` from its trajectories, runs the pure estimator
(`appo_trl.algorithms.tree_credit`) with the config's weights and scaling, and returns `(B, T)` token advantages in
TRL's layout (the loss reads 2-D advantages as it does APPO's). Per-turn rewards arrive as per-token rewards already
placed on each turn's last token (`batch.info["token_rewards"]`, see `appo_trl.trainer.turn_rewards`); without them
each row's reward is its outcome. Each group's `TreeCredit` is kept in `batch.info["tree_credit"]` for the dump.
"""

from __future__ import annotations

import torch

from appo_trl.algorithms.tree_credit import tree_credit
from appo_trl.rollout.group_tree import GroupTree


def tree_advantages(batch, rewards: torch.Tensor, length: int, args) -> torch.Tensor:
    """(B, length) advantages of the local rows of `batch` (groups flattened) from their rewards (B,)."""
    rewards = rewards.detach().float().cpu()
    token_rewards = batch.info.get("token_rewards")
    out = torch.zeros(len(rewards), length)
    credits, row = [], 0
    for group in batch.groups:
        tree, k = GroupTree.of(group), len(group)
        kw = dict(
            weights=(args.tree_credit_global_weight, args.tree_credit_local_weight), scale=args.tree_credit_scale
        )
        if token_rewards is not None:
            credit = tree_credit(*_tree(tree), token_rewards=token_rewards[row : row + k], max_length=length, **kw)
        else:
            credit = tree_credit(*_tree(tree), rewards[row : row + k], max_length=length, **kw)
        out[row : row + k] = credit.advantages
        credits.append(credit)
        row += k
    batch.info["tree_credit"] = credits
    return out


def _tree(tree: GroupTree):
    return list(tree.parents), list(tree.branch_pos), list(tree.lengths)


__all__ = ["tree_advantages"]
