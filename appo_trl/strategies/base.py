"""The strategy contract: `RolloutStrategy` (the facts other code asks a strategy) and the registry.

A strategy turns one round's unique prompts into groups of n rows, a `Round` (`generate`, `strategies.record`), and
may replace TRL's group advantages once rewards are known (`advantages`). Its class declares what the config, the engine set-up, the
environments and the model card would otherwise decide by comparing the strategy's name. `register_strategy`
(a class decorator) adds a class to `STRATEGIES` (name -> class) and hands its paper to the model-card code.
`PolicyForward` is all a strategy sees of the policy it samples for (the trainer implements it and hands itself
over): the strategy is a producer that never imports the trainer and calls nothing of it beyond that Protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from appo_trl.configs.errors import fail
from appo_trl.strategies.record import Round

TRL_STD_EPS = 1e-4  # ε in TRL's (r − mean)/(std + ε) group advantage
TREE_ESTIMATORS = ("tree", "tree_grpo")  # `advantage_estimator` values computed on the group's tree


@dataclass(frozen=True)
class TokenScores:
    """One no-grad policy forward on finished rows (`PolicyForward.score_trajectories`).

    Args:
        logps (`torch.Tensor`): per-token log-probabilities of the sampled ids, (R, T) on CPU, 0 past a row's end.
        entropies (`torch.Tensor`): the exact per-token entropies of the policy, (R, T) on CPU, 0 past a row's end.
    """

    logps: torch.Tensor
    entropies: torch.Tensor


class PolicyForward(Protocol):
    """What a strategy reads of the policy it samples for; `APPOTrainer` implements it.

    `args`: the run's `APPOConfig` (typed `Any`: this floor may not import the config, which imports it).
    `processing_class_tokenizer`: the policy's tokenizer (its vocabulary size, APPO's excluded tokens).
    `score_trajectories(trajectories)`: one no-grad forward of the policy on finished rows, a `TokenScores`
    ((R, T) CPU tensors) (APPO's branch selection; in a background round, the proximal weights).
    """

    args: Any

    @property
    def processing_class_tokenizer(self) -> Any: ...

    def score_trajectories(self, trajectories: list) -> TokenScores: ...


class RolloutStrategy:
    """Base strategy: `generate` one round, then optionally replace the advantages once rewards are known.

    Class facts (override in a subclass):
        name: the `rollout_strategy` value.
        default_loss_mode: `loss_mode` when the config leaves it unset.
        branches: False when every row is an independent rollout (initial_rollouts == n, environments are never
            branched, and in-process with no tools TRL's own sampler serves the round).
        drops_branch_rows: branch rows leave the batch before the loss (only initial rollouts are optimised).
        env_snapshots: branches start after their parent has moved on, so environments keep a snapshot after
            every call (`appo_trl.rollout.environments.RoundEnvironments(snapshots=...)`).
        branches_by_replay: the strategy also branches the user's agent runs: it chooses its points on the recorded
            runs and re-runs the agent by replay (`AgentEngine.branch_many`); without it, agents need
            initial_rollouts == num_generations.
        async_under_sharding: background rounds (max_staleness >= 1) may run under DeepSpeed / FSDP.
        streams: `rollout_stream` can sample its rounds one group (one prompt's tree) at a time: `generate` on one
            prompt needs no forward of the policy (APPO's branch selection does: it is not streamed).
        options: config switches only this strategy reads (refused under another strategy).
        paper: the method's paper for the model card (name, title, arXiv id, BibTeX), `card_title` its line.
        no_tool_calls_note: what a round in which no rollout called a tool costs this strategy (the warning's end).
    """

    name: ClassVar[str] = "base"
    default_loss_mode: ClassVar[str] = "clip"
    branches: ClassVar[bool] = True
    drops_branch_rows: ClassVar[bool] = False
    env_snapshots: ClassVar[bool] = False
    branches_by_replay: ClassVar[bool] = False
    streams: ClassVar[bool] = False
    async_under_sharding: ClassVar[bool] = True
    options: ClassVar[tuple[str, ...]] = ()
    paper: ClassVar[dict[str, str] | None] = None
    card_title: ClassVar[str | None] = None
    metric_keys: ClassVar[tuple[str, ...]] = ()

    @property
    def no_tool_calls_note(self) -> str:
        return f" {self.name.upper()} branches only after tool results: no branching happened."

    def __init__(self, policy: PolicyForward):
        self.policy = policy
        self.args = policy.args

    @classmethod
    def needs_sampler_entropies(cls, args) -> bool:
        """Whether the rollout engine must record top-k sampler entropies for this strategy under `args`."""
        return False

    @classmethod
    def needs_agent_entropies(cls, args) -> bool:
        """Whether the user's agent runs must record top-k sampler entropies (its branch rule reads them)."""
        return cls.needs_sampler_entropies(args)

    @classmethod
    def validate(cls, config) -> None:
        """Fill this strategy's defaults on `config` and refuse what it cannot run (called by `APPOConfig`)."""
        n = config.num_generations
        if config.initial_rollouts is None:
            config.initial_rollouts = max(1, n // 2) if cls.branches else n
        if not 1 <= config.initial_rollouts <= n:
            fail(f"initial_rollouts={config.initial_rollouts} must be in [1, num_generations={n}].")
        if not cls.branches and config.initial_rollouts != n:
            fail(f"rollout_strategy={cls.name} does not branch: initial_rollouts must equal num_generations.")
        if config.loss_mode is None:
            config.loss_mode = cls.default_loss_mode
        for other in STRATEGIES.values():  # another strategy's switch: refused when set, off when unset (None)
            for flag in (f for f in other.options if f not in cls.options):
                if getattr(config, flag):
                    fail(f"{flag}=True is an {other.name.upper()} option; set rollout_strategy={other.name}.")
                setattr(config, flag, False)
        own = cls.own_advantages(config)
        if own is not None and config.multi_objective_aggregation != "sum_then_normalize":
            fail(f"multi_objective_aggregation={config.multi_objective_aggregation} normalises each reward function "
                 f"in TRL's own group advantages, but {own} replaces them with advantages of the summed reward; set "
                 "multi_objective_aggregation: sum_then_normalize.")  # fmt: skip

    @classmethod
    def own_advantages(cls, config) -> str | None:
        """The setting under which this strategy replaces TRL's advantages with its own (`advantages`), or None."""
        if cls.branches and config.advantage_estimator == "tree":
            return "advantage_estimator=tree"
        if config.advantage_std_eps != TRL_STD_EPS:
            return f"advantage_std_eps={config.advantage_std_eps}"
        return None

    def generate(self, prompt_ids: list[list[int]], n: int, seed: int, engine) -> Round:
        """One round: n rows per unique prompt of `prompt_ids`, sampled on `engine` (an object with
        `RolloutEngine`'s `rollout`, `branch_many`, `run` and `config`: the round's sampling path hands it over,
        `appo_trl.trainer.sampling_paths`)."""
        raise NotImplementedError

    def advantages(self, rnd: Round, rewards: torch.Tensor, default: torch.Tensor, length: int) -> torch.Tensor:
        """Advantages for the local rows of `rnd` (before any row is dropped); TRL's group advantages by default.
        `rewards` (B,): TRL's summed reward per row, NaN for an unscorable one (`trl_rules.scored_rewards`).

        With `advantage_std_eps` other than TRL's 1e-4 (the released code: 1e-6) the group advantages are
        recomputed as (r − mean_g)/(std_g + ε) with TRL's unbiased group std (`scale_rewards: group` only).
        `advantage_estimator: tree` (`tree_grpo`): (B, length) token ((B,) row) advantages from the groups' trees
        (`appo_trl.strategies.credit`).
        """
        if self.branches and self.args.advantage_estimator in TREE_ESTIMATORS:  # (not grpo's eval rounds)
            from appo_trl.strategies.credit import tree_advantages

            return tree_advantages(rnd, rewards, length, self.args).to(default.device)
        eps = self.args.advantage_std_eps
        if eps == TRL_STD_EPS:
            return default
        from appo_trl.algorithms.advantages import group_advantages

        n = len(rnd.groups[0]) if rnd.groups else 1
        return group_advantages(rewards, n, std="unbiased", eps=eps).to(default)


STRATEGIES: dict[str, type[RolloutStrategy]] = {}


def register_strategy(cls: type[RolloutStrategy]) -> type[RolloutStrategy]:
    """Class decorator: `rollout_strategy: <cls.name>` selects `cls`; its paper goes to the model cards."""
    from appo_trl.reporting.hub import register_method

    if not (isinstance(cls, type) and issubclass(cls, RolloutStrategy)):
        raise TypeError(f"register_strategy: {cls!r} is not a RolloutStrategy subclass")
    STRATEGIES[cls.name] = cls
    if cls.paper is not None:
        register_method(cls.name, cls.paper, cls.card_title)
    return cls


def strategy_class(name: str) -> type[RolloutStrategy]:
    """The registered class of `rollout_strategy: name`; a config error naming the registered ones otherwise."""
    if name not in STRATEGIES:
        fail(f"rollout_strategy={name!r}; choose one of {tuple(STRATEGIES)}.")
    return STRATEGIES[name]
