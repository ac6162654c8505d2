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
the answer turn's (`tests/trainer/test_turn_rewards.py`). An agent (`APPOTrainer(agent=...)`) may return a list with
one reward per model call instead of one number (`call_rewards_per_turn`): each call's reward lands on the last
sampled token of that call's answer (an answer left empty because the row's budget was spent: the chain's last
sampled token before it), and TRL gets the run's total. Every call must have landed in the run's row: an agent that
rewrote its history (its other chains are rows of their own, `Trajectory.chain_rows`, trained with the run's
advantage, outside the tree) cannot give per-call rewards, and such a run is refused in one line as the agent's
fault, as is a list whose length is not the number of calls.
"""

from __future__ import annotations

import bisect
import math

import torch

from appo_trl.rollout.group_tree import turn_ends
from appo_trl.trainer.reward_checks import RewardFunctionError


def token_rewards(trainer, rows, local: torch.Tensor, turns: dict, out: dict) -> torch.Tensor:
    """(B, T) per-token rewards of the local rows; `local` is TRL's (B, F) rewards of these rows."""
    names, weights = trainer.reward_func_names, trainer.reward_weights.tolist()
    return place_turn_rewards(rows, local.detach().cpu(), names, weights, turns, out["completion_ids"].size(1))


def place_turn_rewards(rows, local, names, weights, turns: dict, length: int) -> torch.Tensor:
    """Each function's reward on its row: per turn on each turn's last sampled token, else on the last token.

    A function whose value on the row is NaN places nothing, its per-turn list included: it returned None, or its
    value was dropped because an agent's own number wins (`agents.agent_rewards_override`)."""
    placed = torch.zeros(len(rows), length, dtype=torch.float64)
    for i, row in enumerate(rows):
        n, ends = len(row.completion_ids), turn_ends(row.loss_mask)
        for f, (name, w) in enumerate(zip(names, weights)):
            r, values = float(local[i, f]), turns.get((name, i))
            if math.isnan(r):
                continue
            if values is None:
                if n:
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


def call_rewards_per_turn(answered: list[tuple[int, int]], row, values: list[float]) -> list[float]:
    """An agent's rewards per model call (`values`, in call order) as rewards per assistant turn of its `row`.

    `answered`: each call's (chain index, last sampled token), `AgentSession.answered`. ValueError, in one line, for
    a wrong number of rewards or a call that is not on `row`."""
    if len(values) != len(answered):
        raise ValueError(f"returned {len(values)} per-call rewards for a run of {len(answered)} model call(s); "
                         "return one reward per call (or one number)")  # fmt: skip
    elsewhere = sum(chain != row.chain for chain, _ in answered)
    if elsewhere:
        raise ValueError(f"returned per-call rewards, but {elsewhere} of its {len(answered)} calls started other "
                         "chains (it rewrote its history, so those calls are rows of their own outside the tree); "
                         "per-call rewards need one chain per run: return one number")  # fmt: skip
    ends = turn_ends(row.loss_mask)
    per_turn = [0.0] * len(ends)
    for (_, end), value in zip(answered, values):
        if end < 0:
            raise ValueError("returned per-call rewards, but a call sampled nothing before it: its reward has no "
                             "token; return one number")  # fmt: skip
        per_turn[bisect.bisect_left(ends, end)] += value  # the turn holding the call's last sampled token
    return per_turn


__all__ = ["call_rewards_per_turn", "place_turn_rewards", "token_rewards"]
