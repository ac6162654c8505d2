"""TRL's `environment_factory` on every strategy: start-up checks, and the environments of one generation round.

TRL's own `GRPOTrainer` does most of the work and `APPOTrainer` keeps it: its `__init__` probes one instance per
environment (a callable `reset` is required), adds a reward column per class that defines `get_reward`, refuses
a run with no reward source, and builds a placeholder dataset when the environment owns the data (`max_steps`
required, a single environment only); its `_generate_and_score_completions` draws one pooled instance per row,
rejects an unknown `environment` name, calls `reset(**row)` and appends the observation to the last user
message; its `_tokenize_prompts` renders each row's tool schemas; its reward step passes `environments=` to
the reward functions and calls `get_reward()` on each row's instance.

What this module adds, so that the rollout engine can sample with environments and branch them:
- `share_group_tasks` (every round, environment-owned data only: no `train_dataset`, TRL's `IncrementEnv`
  pattern): a branching strategy needs one task per group, so when `reset()` sampled different tasks for the rows
  of a group, every row takes a deep copy of the group's first instance (just after its reset) and its prompt;
  an environment that cannot be deep-copied is refused with advice (a dataset that carries the task, or grpo).
- `check_environments` (start-up): environments are chat-template tools (`tool_format: chat`), every method
  is a valid tool, and for a branching strategy each environment has a branch mode (`appo_trl.rollout.environments`:
  deep copy, or replay of the parent's calls; one clear error otherwise).
- `round_environments` (every round): a `RoundEnvironments` over TRL's reset instances, so that roots use
  them, extra roots and `replay` branches get fresh instances reset with the same row (whose observation must
  render the group's prompt: one clear error otherwise), and every row of the batch ends with its own instance (`RoundEnvironments.rows`, which the trainer stores as `self.environments`
  for TRL's reward step: `get_reward()` is called once per row, branches included).

What it does not do: sample, call tools (the engine does), or score (TRL does).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from appo_trl import trl_rules
from appo_trl.rollout.environments import RoundEnvironments, branch_mode, environment_methods
from appo_trl.strategies.record import HandedEnvironments
from appo_trl.tools.callables import ToolSpecError, tool_schema
from appo_trl.trainer import trl_seams


def check_environments(trainer) -> None:
    """After TRL's `__init__`: check each environment's tools and, for branching strategies, its branch mode."""
    trainer._env_branch_modes = {}
    if trainer.environment_factories is None:
        return
    strategy = trainer.args.strategy_class
    methods = set()
    for name, pool in trl_seams.environment_pool(trainer).items():
        probe = pool[0]  # TRL's probe instance
        for method_name, method in environment_methods(probe).items():
            methods.add(method_name)
            try:
                tool_schema(method, f"{type(probe).__name__}.{method_name}")
            except ToolSpecError as exc:
                raise ToolSpecError(f"environment_factory: {exc}") from None
        trainer._env_branch_modes[name] = branch_mode(probe, strategy.name) if strategy.branches else None
    unknown = sorted(set(trainer.startup_plan.environment_timeouts) - methods)
    if unknown:
        raise ValueError(f"tool_config names {unknown}, which are neither tools nor environment methods "
                         f"(the environments' methods: {sorted(methods)})")  # fmt: skip


def share_group_tasks(trainer, strategy, prompts: list, n: int, own: OwnInstances | None = None) -> None:
    """Environment-owned data and a branching strategy: the rows of each group take the first row's task (a deep
    copy of its instance, just reset, and its prompt; `prompts` is TRL's list, changed in place so that its reward
    step and logs read the prompt each row was sampled on). `own`: a background round's instances instead of TRL's."""
    if not trainer._env_owns_data or not strategy.branches:
        return
    envs, names = (trainer.environments, trl_seams.batch_environment_names(trainer)) if own is None else (own.instances, own.names)
    for s in range(0, len(prompts), n):
        if all(prompts[j] == prompts[s] for j in range(s, s + n)):
            continue
        if trainer._env_branch_modes.get(names[s]) != "deepcopy":
            raise ValueError(
                f"environment_factory without a train_dataset and rollout_strategy={strategy.name}: reset() sampled "
                f"different tasks for the rows of one group, and {type(envs[s]).__name__} cannot be deep-copied to "
                "share the first one's (branch_mode 'replay'). Pass a train_dataset whose rows carry the task and "
                "let reset(**row) read it (TRL's 'Providing an external dataset' pattern), or use rollout_strategy: grpo"
            )
        for j in range(s + 1, s + n):
            envs[j], prompts[j] = copy.deepcopy(envs[s]), prompts[s]


def _fresh(trainer, row: dict, name, prompt_ids: list[int], index: int):
    """A new instance of environment `name`, `reset()` with `row` as TRL does (no `environment` key when several);
    its observation must give the prompt the group was sampled on (`prompt_ids`, row `index`), else ValueError."""
    env = trainer.environment_factories[name]()
    observation = env.reset(**trl_rules.reset_kwargs(trainer, row))
    prompt = trl_rules.observed_prompt(row, observation)
    if trl_rules.environment_prompt_ids(trainer, prompt, trl_seams.environment_tools(trainer, name)) != list(prompt_ids):
        raise ValueError(
            f"environment_factory: a new {type(env).__name__} instance reset() with row {index} returned "
            f"{str(observation)[:200]!r}, a different observation from the one its group was sampled on; refills "
            "and replayed branches get new instances, so reset() must return the same observation for the same "
            "dataset row (seed its randomness from the row)"
        )
    return env


@dataclass
class OwnInstances:
    """A background round's own environment instances, one per row, and the prompts their `reset()` gave (TRL's
    shape); TRL's pooled instances, reset on the trainer's thread for the round being scored, are never touched."""

    instances: list
    names: list
    prompts: list


def own_instances(trainer, inputs: list[dict]) -> OwnInstances:
    """New instances from the factories for generation batch `inputs`, each `reset()` with its row as TRL resets its
    pool (no `environment` key when several), and each row's prompt with its observation."""
    multi = trl_seams.multi_environment(trainer)
    names = [x.get("environment") if multi else None for x in inputs]
    unknown = sorted({str(x) for x in names if x not in trainer.environment_factories})
    if unknown:
        raise ValueError(f"Example has `environment={unknown[0]!r}`, which is not among the environments passed to "
                         f"`environment_factory`. Expected one of: {list(trainer.environment_factories)}.")  # fmt: skip
    instances, prompts = [], []
    for row, name in zip(inputs, names):
        env = trainer.environment_factories[name]()
        observation = env.reset(**trl_rules.reset_kwargs(trainer, row))
        instances.append(env)
        prompts.append(trl_rules.observed_prompt(row, observation))
    return OwnInstances(instances, names, prompts)


def own_prompt_ids(trainer, own: OwnInstances) -> list[list[int]]:
    """The ids of `own`'s prompts, each rendered with its environment's tools (as TRL's `_tokenize_prompts`)."""
    return [trl_rules.environment_prompt_ids(trainer, p, trl_seams.environment_tools(trainer, name))
            for p, name in zip(own.prompts, own.names)]  # fmt: skip


def round_environments(
    trainer, prompt_ids: list[list[int]], n: int, strategy, inputs: list[dict], own: OwnInstances | None = None
) -> tuple[RoundEnvironments, bool]:
    """The environments of this round, and whether the rows of one prompt must be sampled as groups of one.

    TRL has reset one instance per row (`trainer.environments`); when `reset()` returned different observations
    for the n rows of one prompt, their prompts differ: grpo then samples each row on its own prompt (as TRL),
    and a branching strategy raises (a branch shares its group's prompt). `strategy`: the round's `RolloutStrategy`.
    """
    rows, names = (trainer.environments, trl_seams.batch_environment_names(trainer)) if own is None else (own.instances, own.names)
    if not len(rows) == len(names) == len(inputs) == len(prompt_ids):
        raise RuntimeError(f"{len(rows)} environments for {len(prompt_ids)} rows")
    per_row = any(prompt_ids[i] != prompt_ids[i - i % n] for i in range(len(prompt_ids)))
    if per_row and strategy.branches:
        first = next(i for i in range(len(prompt_ids)) if prompt_ids[i] != prompt_ids[i - i % n])
        raise ValueError(
            f"environment_factory with rollout_strategy={strategy.name}: reset() returned a different observation for "
            f"row {first} than for the first row of its prompt; branches share their group's prompt, so reset() "
            "must return the same observation for the same dataset row (seed its randomness from the row), or "
            "use rollout_strategy: grpo"
        )
    size = 1 if per_row else n
    starts = range(0, len(prompt_ids), size)
    modes = trainer._env_branch_modes if strategy.branches else {}
    shared = trainer._env_owns_data and strategy.branches  # share_group_tasks: copies, no reset

    def make(s: int):
        if shared and modes.get(names[s]) == "deepcopy":
            snapshot = copy.deepcopy(rows[s])  # the group's instance just after its reset
            return lambda: copy.deepcopy(snapshot)
        return lambda: _fresh(trainer, inputs[s], names[s], prompt_ids[s], s)

    return RoundEnvironments(
        instances=[rows[s : s + size] for s in starts],
        make=[make(s) for s in starts],
        modes=[modes.get(names[s]) for s in starts],
        snapshots=strategy.env_snapshots,
        timeouts=trainer.startup_plan.environment_timeouts,  # tool_config: {method: {timeout: s}}
    ), per_row


def generate_with_environments(trainer, strategy, prompt_ids: list[list[int]], n: int, seed: int, inputs: list[dict],
                               engine, own: OwnInstances | None = None):  # fmt: skip
    """`strategy.generate` on `engine` with one environment per trajectory (`inputs`: the rows TRL reset them with);
    leaves each row's instance in `trainer.environments` for TRL's reward step. A background round (`own`: its own
    instances) leaves them, and its prompts, in `Round.environments` for its hand-over instead."""
    envs, per_row = round_environments(trainer, prompt_ids, n, strategy, inputs, own)
    if not hasattr(engine, "environments"):
        raise TypeError(
            f"environment_factory needs a rollout engine with environments; {type(engine).__name__} has none"
        )
    engine.environments = envs
    try:
        if per_row:  # grpo only: each row on its own prompt, then regrouped n per prompt
            batch = strategy.generate(prompt_ids, 1, seed, engine)
            flat = batch.rows
            batch.groups = [flat[i : i + n] for i in range(0, len(flat), n)]
        else:
            batch = strategy.generate(prompt_ids[::n], n, seed, engine)
    finally:
        engine.environments = None
    if own is None:
        trainer.environments = envs.rows(batch.rows)
    else:
        batch.environments = HandedEnvironments(envs.rows(batch.rows), own.prompts)
    return batch
