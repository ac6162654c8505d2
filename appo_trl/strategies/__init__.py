"""Floor 6: rollout strategies of `APPOTrainer`: how one generation round turns unique prompts into groups of n rows.

One module per strategy (`grpo`, `arpo`, `aepo`, `appo`), each a `RolloutStrategy` subclass that declares its
facts (default loss mode, branching, sampler entropies, environment snapshots, async under sharding, paper) and
its part of the config validation. `STRATEGIES`: name -> class; `register_strategy` adds one, so a new strategy
is one class (see `tests/trainer/test_fifth_strategy.py`). `arpo_replay` applies ARPO / AEPO's in-loop rule to
recorded runs (the user's agent, which branches by replay). A strategy orchestrates the rollout engine
(`appo_trl.rollout`) and the maths of `appo_trl.algorithms`; it holds no trainer state across rounds.

It also holds the round's record (`record`: `Round`) and tree credit (`credit`: the advantage step of
`advantage_estimator: tree` / `tree_grpo`). A strategy sees the policy only through `PolicyForward` (`base`).

What this package does not do: tokenise prompts, gather across ranks, log, or compute losses (the trainer does).
It imports floors 1-5 only: never `config` (which imports it), `trainer`, `stages`, `synthetic` or `cli`.
"""

from appo_trl.strategies.aepo import AEPOStrategy
from appo_trl.strategies.appo import APPOStrategy, excluded_token_mask
from appo_trl.strategies.arpo import ARPOStrategy, BranchHook
from appo_trl.strategies.base import (
    STRATEGIES,
    TRL_STD_EPS,
    PolicyForward,
    RolloutStrategy,
    TokenScores,
    register_strategy,
    strategy_class,
)
from appo_trl.strategies.grpo import GRPOStrategy
from appo_trl.strategies.record import AgentReport, HandedEnvironments, Round

__all__ = [
    "STRATEGIES", "TRL_STD_EPS", "PolicyForward", "TokenScores", "RolloutStrategy", "Round", "AgentReport", "HandedEnvironments", "register_strategy", "strategy_class",
    "GRPOStrategy", "ARPOStrategy", "BranchHook", "AEPOStrategy", "APPOStrategy", "excluded_token_mask",
]  # fmt: skip
