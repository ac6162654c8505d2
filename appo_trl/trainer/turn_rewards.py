"""Per-turn rewards placed on their own tokens: the per-token rewards the tree estimator turns into return-to-go.

A reward function that returns, for a completion, a list with one reward per assistant turn
(`appo_trl.trainer.reward_checks`) gets each reward on the last sampled token of its turn: turns are the maximal
runs of sampled tokens (`appo_trl.rollout.group_tree.turn_ends`: an assistant turn of the chat format, ended by its
own end-of-turn token; tool results and the template between turns are masked and belong to no turn). A function
that returns one number for the completion puts it on the row's last token. Each reward is weighted by
`reward_weights`. The estimator (`appo_trl.algorithms.tree_credit`) then credits token t with the return-to-go from
t, against baselines that depend only on the prompt or on a tree node, never on the turn index.

An environment (TRL's `environment_factory`) reports a reward after each tool call the same way: its `get_reward()`
(which TRL turns into a reward function named after its class) returns the rewards it recorded per call turn, then
the answer turn's (`tests/trainer/test_turn_rewards.py`). Not yet: an agent returning one reward per model call (its
return value must be one number).
"""

from __future__ import annotations

import math

import torch

from appo_trl.rollout.group_tree import turn_ends
from appo_trl.trainer.reward_checks import RewardFunctionError


def token_rewards(trainer, rows, local: torch.Tensor, turns: dict, out: dict) -> torch.Tensor:
    """(B, T) per-token rewards of the local rows; `local` is TRL's (B, F) rewards of these rows."""
    names, weights = trainer.reward_func_names, trainer.reward_weights.tolist()
    return place_turn_rewards(rows, local.detach().cpu(), names, weights, turns, out["completion_ids"].size(1))


def place_turn_rewards(rows, local, names, weights, turns: dict, length: int) -> torch.Tensor:
    """Each function's reward on its row: per turn on each turn's last sampled token, else on the last token."""
    placed = torch.zeros(len(rows), length, dtype=torch.float64)
    for i, row in enumerate(rows):
        n, ends = len(row.completion_ids), turn_ends(row.loss_mask)
        for f, (name, w) in enumerate(zip(names, weights)):
            values = turns.get((name, i))
            if values is None:
                r = float(local[i, f])
                if n and not math.isnan(r):
                    placed[i, n - 1] += w * r
                continue
            if len(values) != len(ends):
                raise RewardFunctionError(
                    f"reward function {name!r} returned {len(values)} per-turn rewards for completion {i}, which has "
                    f"{len(ends)} assistant turn(s); return one reward per turn"
                )
            for end, r in zip(ends, values):
                placed[i, end] += w * r
    return placed


__all__ = ["place_turn_rewards", "token_rewards"]
