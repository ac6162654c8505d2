"""Tree credit for a round: the strategy's advantage step when `advantage_estimator: tree` or `tree_grpo`.

`tree_advantages` builds each group's `GroupTree` from its trajectories and runs the pure estimator
(`appo_trl.algorithms.tree_credit`): the paper's form with the config's weights and scaling, or TreeRL's released
form (`tree_credit_form: treerl_released`, selected rows = `batch.keep`, the rows that reach the loss). It returns
`(B, T)` token advantages in TRL's layout (the loss reads 2-D advantages as it does APPO's). Per-turn rewards
arrive as per-token rewards already placed on each turn's last token (`batch.info["token_rewards"]`, see
`appo_trl.trainer.turn_rewards`); without them each row's reward is its outcome. Each group's `TreeCredit` is kept
in `batch.info["tree_credit"]` for the dump. `tree_grpo` returns Tree-GRPO's `(B,)` advantages
(`appo_trl.algorithms.advantages.tree_grpo_advantages`) over the groups and their lineage trees (`lineage_roots`).
"""

from __future__ import annotations

import torch

from appo_trl.algorithms.advantages import tree_grpo_advantages
from appo_trl.algorithms.tree_credit import tree_credit, treerl_released_credit
from appo_trl.rollout.group_tree import GroupTree, lineage_roots


def tree_advantages(batch, rewards: torch.Tensor, length: int, args) -> torch.Tensor:
    """(B, length) advantages of the local rows of `batch` (groups flattened) from their rewards (B,); (B,) for
    `tree_grpo`."""
    rewards = rewards.detach().float().cpu()
    if args.advantage_estimator == "tree_grpo":
        return _tree_grpo(batch, rewards, args)
    token_rewards = batch.info.get("token_rewards")
    released = args.tree_credit_form == "treerl_released"
    if released and token_rewards is not None:
        raise ValueError(
            "tree_credit_form=treerl_released takes one outcome reward per row (the released code has no per-turn "
            "rewards), but a reward function returned per-turn lists; return one number or use the paper form."
        )
    out = torch.zeros(len(rewards), length)
    credits, row = [], 0
    for group in batch.groups:
        tree, k = GroupTree.of(group), len(group)
        if released:
            keep = list(batch.keep[row : row + k])
            credit = treerl_released_credit(*_tree(tree), rewards[row : row + k], selected=keep, max_length=length)
        else:
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


def _tree_grpo(batch, rewards: torch.Tensor, args) -> torch.Tensor:
    """Tree-GRPO over the local groups: each group its prompt, each lineage root and its branches a tree."""
    groups, trees, row = [], [], 0
    for g, group in enumerate(batch.groups):
        groups += [g] * len(group)
        trees += [row + r for r in lineage_roots(group)]
        row += len(group)
    return tree_grpo_advantages(rewards, groups, trees, combine=args.tree_grpo_combine)


def _tree(tree: GroupTree):
    return list(tree.parents), list(tree.branch_pos), list(tree.lengths)


__all__ = ["tree_advantages"]
