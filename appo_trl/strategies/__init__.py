"""Rollout strategies of `APPOTrainer`: how one generation round turns unique prompts into groups of n rows.

One module per strategy (`grpo`, `arpo`, `aepo`, `appo`), each a `RolloutStrategy` subclass that declares its
facts (default loss mode, branching, sampler entropies, environment snapshots, async under sharding, paper) and
its part of the config validation. `STRATEGIES`: name -> class; `register_strategy` adds one, so a new strategy
is one class (see `tests/trainer/test_fifth_strategy.py`). `arpo_replay` applies ARPO / AEPO's in-loop rule to
recorded runs (the user's agent, which branches by replay). A strategy orchestrates the rollout engine
(`appo_trl.rollout`) and the maths of `appo_trl.algorithms`; it holds no trainer state across rounds.

What this package does not do: tokenise prompts, gather across ranks, log, or compute losses (the trainer does).
"""

from appo_trl.trainer.strategies.aepo import AEPOStrategy
from appo_trl.trainer.strategies.appo import APPOStrategy, excluded_token_mask
from appo_trl.trainer.strategies.arpo import ARPOStrategy, BranchHook
from appo_trl.trainer.strategies.base import (
    STRATEGIES,
    TRL_STD_EPS,
    RolloutStrategy,
    register_strategy,
    strategy_class,
)
from appo_trl.trainer.strategies.grpo import GRPOStrategy
from appo_trl.trainer.strategies.record import AgentReport, HandedEnvironments, Round

__all__ = [
    "STRATEGIES", "TRL_STD_EPS", "RolloutStrategy", "Round", "AgentReport", "HandedEnvironments", "register_strategy", "strategy_class",
    "GRPOStrategy", "ARPOStrategy", "BranchHook", "AEPOStrategy", "APPOStrategy", "excluded_token_mask",
]  # fmt: skip
