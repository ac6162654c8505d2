"""The sampling path of one `APPOTrainer`: which sampler serves its rounds, resolved once at start-up.

Four paths, one class each in `PATHS` (name -> class):
- `trl`: TRL's own `GRPOTrainer._generate` (grpo without tools, in-process and synchronous; or a `rollout_func`);
- `tool_loop`: appo-trl's rollout engine and its tool loop;
- `environments`: TRL's `environment_factory` on that engine, one instance per trajectory
  (`appo_trl.trainer.environments`);
- `agent`: the user's agent through the OpenAI-compatible endpoint (`appo_trl.trainer.agents`).

`resolve_path(given)` picks the path from what the constructor was given (`Given`) and refuses, from the one table
`REFUSALS` ((path, setting) -> the one-line reason), every setting that path cannot honour, before the model loads.
The `RoundRunner` builds the path object once (`path.bind(runner)`) and the path owns each round's life on it:
`prepare` (the trainer's thread, before the prompts are tokenised), `sample(strategy, prompt_ids, n, seed, inputs)`
(any thread: it hands the strategy the engine its round samples on, `RolloutStrategy.generate(..., engine)`),
`hand_over` (the trainer's thread, as the round reaches TRL), `completions` and `extra_fields` (what TRL's reward
functions get), `tool_metrics`, `after_scoring` (the rows after the advantages) and `close`. Under `rollout_stream`
a path that `streams` also starts one group at a time (`start_group`, the trainer's thread, not blocking) and
gives the handed-over round what its groups carry (`stream_round`). What this module does not do: score, or hold
rounds.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from trl.data_utils import is_conversational

from appo_trl.sampling import Sampler, missing_members
from appo_trl.strategies import Round
from appo_trl.strategies.record import HandedEnvironments
from appo_trl.trainer import trl_seams


@dataclass(frozen=True)
class Given:
    """What `APPOTrainer.__init__` was given that decides the sampling path (before the model loads)."""

    args: Any  # the APPOConfig
    agent: Any = None  # the resolved agent callable
    tools: bool = False  # tools configured (`tools=` or `APPOConfig.tools`)
    rollout_func: Any = None
    environment_factory: Any = None
    rollout_engine: Any = None

    @property
    def agent_name(self) -> str:
        from appo_trl.trainer.agents import agent_label

        return agent_label(self.agent) if self.agent is not None else ""


# setting -> whether `Given` sets it (the columns of `REFUSALS`)
SETTINGS: dict[str, Callable[[Given], bool]] = {
    "tools": lambda g: g.tools,
    "rollout_func": lambda g: g.rollout_func is not None,
    "environment_factory": lambda g: g.environment_factory is not None,
    "rollout_engine": lambda g: g.rollout_engine is not None,
    "branching": lambda g: g.args.strategy_class.branches,
    "branching_without_replay": lambda g: (
        g.args.strategy_class.branches
        and not g.args.strategy_class.branches_by_replay
        and g.args.initial_rollouts != g.args.num_generations
    ),
    "max_staleness": lambda g: g.args.max_staleness >= 1,
    "tool_format_tags": lambda g: g.args.tool_format == "tags",
    "dump_rollouts": lambda g: bool(g.args.dump_rollouts),
}

_CLASH = "agent {agent}: the agent runs its own loop and tools; {setting} cannot be set too"

# (path, setting) -> why that path cannot honour the setting: every refusal of a sampling path, checked in this order
REFUSALS: dict[tuple[str, str], str] = {
    ("agent", "tools"): _CLASH,
    ("agent", "rollout_func"): _CLASH,
    ("agent", "environment_factory"): _CLASH,
    ("agent", "branching_without_replay"): (
        "agent {agent} with rollout_strategy={strategy}: this strategy cannot branch an agent's runs by replay; set "
        "initial_rollouts={n} (= num_generations)"
    ),
    ("trl", "branching"): (
        "APPOTrainer: rollout_func is supported for rollout_strategy=grpo only ({strategy} branches from token "
        "prefixes of appo-trl's rollout engine); pass rollout_engine= (an object with RolloutEngine's "
        "rollout/branch_many/run) for a custom sampler, or use rollout_strategy=grpo."
    ),
    ("trl", "tools"): (
        "APPOTrainer: rollout_func replaces the sampler and the tool loop; drop the tools (run them inside the "
        "rollout_func) or drop rollout_func and let appo-trl's engine run the tools."
    ),
    ("trl", "environment_factory"): (
        "APPOTrainer: rollout_func replaces the sampler and the tool loop that calls the environments' methods; "
        "drop rollout_func (appo-trl's engine runs environment_factory) or drop environment_factory."
    ),
    ("trl", "rollout_engine"): (
        "APPOTrainer: pass rollout_func or rollout_engine, not both (each replaces the sampler)."
    ),
    ("trl", "max_staleness"): (
        "APPOTrainer: max_staleness >= 1 runs rounds on appo-trl's rollout engine in the background; a rollout_func "
        "runs on TRL's own sampler. Set max_staleness: 0."
    ),
    ("trl", "dump_rollouts"): (
        "dump_rollouts needs appo-trl's rollout engine, but grpo without tools runs TRL's own sampler: enable a tool "
        "(tools: [python]) or use TRL's log_completions instead."
    ),
    ("environments", "tool_format_tags"): (
        "environment_factory: environment methods are chat-template tools (as in TRL); set tool_format: chat (tags "
        "is ARPO's tag format for built-in tools)"
    ),
}


def refusal(path: str, given: Given) -> str | None:
    """The first reason in `REFUSALS` why `path` cannot serve `given`, or None."""
    a = given.args
    for (name, setting), reason in REFUSALS.items():
        if name == path and SETTINGS[setting](given):
            return reason.format(agent=given.agent_name, setting=setting, strategy=a.rollout_strategy,
                                 n=a.num_generations)  # fmt: skip
    return None


class SamplingPath:
    """One sampler of rounds and the owner of each round's life (module docstring). `sample` returns the `Round` (on
    any thread: background rounds too); every other hook runs on the trainer's thread."""

    name: ClassVar[str] = "base"
    trl_sampler: ClassVar[bool] = False  # True: TRL's own `_generate` serves the round, `sample` is never called
    reshapes_rows: ClassVar[bool] = False  # `after_scoring` may add rows: the batch is rebuilt on every rank
    streams: ClassVar[bool] = False  # rollout_stream: `start_group` samples one group (`trainer.stream_rounds`)

    @classmethod
    def serves(cls, given: Given) -> bool:
        raise NotImplementedError

    def bind(self, runner) -> SamplingPath:
        self.runner, self.trainer = runner, runner.trainer
        return self

    def sample(self, strategy, prompt_ids: list[list[int]], n: int, seed: int, inputs: list[dict]):
        raise NotImplementedError

    def background_job(self, strategy, inputs: list[dict], n: int, seed: int) -> Callable[[], Any]:
        """On the trainer's thread: what a background round of generation batch `inputs` needs (its prompt ids);
        the returned job runs `sample` on the round's thread."""
        prompt_ids = trl_seams.tokenize_prompts(self.trainer, [x["prompt"] for x in inputs])
        return lambda: self.sample(strategy, prompt_ids, n, seed, inputs)

    def prepare(self, strategy, prompts: list, n: int) -> None:
        """Before TRL's prompts of a foreground round are tokenised (`prompts`: TRL's list, n rows per prompt)."""

    def hand_over(self, rnd: Round, mode: str, prompts: list) -> None:
        """On the trainer's thread, once per round handed to TRL (`prompts`: TRL's list for the round)."""

    def completions(self, rows: list, texts: list[str], prompts: list) -> list:
        """What TRL's reward functions get as `completions`: TRL's tool-loop messages with chat tools, one assistant
        message for a conversational prompt, else the decoded texts."""
        t = self.trainer
        if t.chat_tool_format is not None:  # TRL's tool-loop shape: assistant (tool_calls), tool, ..., assistant
            return [t.chat_tool_format.completion_messages(r) for r in rows]
        if is_conversational({"prompt": prompts[0]}):
            return [[{"role": "assistant", "content": text}] for text in texts]
        return texts

    def extra_fields(self, rows: list) -> dict[str, list]:
        """TRL's `extra_fields` of the round: columns every reward function may read."""
        return {
            "num_tool_calls": [int(r.num_calls) for r in rows],
            "branch_origin": [r.origin for r in rows],
            "branch_pos": [-1 if r.branch_pos is None else int(r.branch_pos) for r in rows],
        }

    def tool_metrics(self, metrics: dict[str, float], rows: list) -> dict[str, float]:
        """The engine's `tools/*` statistics of the round (canonical names)."""
        return metrics

    def after_scoring(self, out: dict, rnd: Round, keep: list[bool]) -> tuple[dict, list[bool]]:
        """TRL's scored batch after the strategy's advantages, and which of its rows reach the loss."""
        return out, keep

    def close(self) -> None:
        """At the end of `train()` (Ctrl-C included), before the engine closes."""

    # ---- rollout_stream (`appo_trl.trainer.stream_rounds`) --------------------------------------------------------
    def stream_prompt_ids(self, prompts: list) -> list[list[int]]:
        """The ids a streamed group of each prompt samples on, at feed time (TRL's tokenisation)."""
        return [list(p) for p in trl_seams.tokenize_prompts(self.trainer, prompts)]

    def start_group(self, group, n: int) -> concurrent.futures.Future:
        """One `StreamGroup`'s n rows (grpo), scheduled on the sampler's loop; on the trainer's thread, not blocking."""
        engine, prompt_ids, seed = self.runner.engine, group.prompt_ids, group.seed

        async def one_group():
            return (await engine.rollout([prompt_ids], n, seed=seed))[0]

        return engine.submit(one_group())

    def stream_round(self, rnd: Round, groups: list) -> None:
        """The handed-over `rnd` of streamed `groups`: what they carry for the path's `hand_over`."""


class TRLSampler(SamplingPath):
    """TRL's own sampler: grpo without tools, in-process, synchronous and with no injected engine, or a
    `rollout_func` (served by TRL's `_generate`)."""

    name, trl_sampler = "trl", True

    @classmethod
    def serves(cls, given: Given) -> bool:
        a = given.args
        if given.rollout_func is not None:
            return True
        return not (a.strategy_class.branches or given.tools or a.use_vllm or given.rollout_engine is not None
                    or given.environment_factory is not None or a.max_staleness or given.agent is not None)  # fmt: skip


class ToolLoop(SamplingPath):
    """appo-trl's rollout engine: the strategy samples (and branches) on it, with the tool loop."""

    name, streams = "tool_loop", True

    @classmethod
    def serves(cls, given: Given) -> bool:
        return True

    def sample(self, strategy, prompt_ids, n, seed, inputs):
        return strategy.generate(prompt_ids[::n], n, seed, self.runner.engine)

    # ---- rollout_stream: a branching strategy (arpo, aepo) samples one prompt's tree per group
    _trees: concurrent.futures.ThreadPoolExecutor | None = None

    def start_group(self, group, n):
        """grpo: the base's one `rollout` on the engine's loop. A branching strategy: its own `generate` on the
        group's prompt (the tree: roots, the branches its rule makes, the refills), which blocks on the engine, on a
        thread of the path's pool; the tree's metrics stay with the group."""
        strategy = self.runner.strategy
        if not strategy.branches:
            return super().start_group(group, n)
        if self._trees is None:
            self._trees = concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="appo-stream-tree")
        engine, prompt_ids, seed = self.runner.engine, group.prompt_ids, group.seed

        def one_tree():
            rnd = strategy.generate([prompt_ids], n, seed, engine)
            group.metrics = dict(rnd.metrics)
            return rnd.groups[0]

        return self._trees.submit(one_tree)

    def stream_round(self, rnd, groups):
        """A branching strategy's metrics of the handed-over groups' trees: per metric, the mean over the trees that
        report it (one prompt each: the round's value for its per-prompt and per-row means; a ratio such as
        `branch/probability_mean` becomes the mean of the trees' ratios)."""
        per_tree = [g.metrics for g in groups if g.metrics]
        keys = {k for m in per_tree for k in m}
        values = {k: [m[k] for m in per_tree if k in m and math.isfinite(m[k])] for k in sorted(keys)}
        rnd.metrics = {k: (sum(v) / len(v) if v else math.nan) for k, v in values.items()}

    def close(self):
        pool, self._trees = self._trees, None
        if pool is not None:  # a tree still sampling ends when the engine closes (after this)
            pool.shutdown(wait=False, cancel_futures=True)


class Environments(SamplingPath):
    """TRL's `environment_factory` on the rollout engine: one instance per trajectory, branches included."""

    name, streams = "environments", True

    @classmethod
    def serves(cls, given: Given) -> bool:
        return given.environment_factory is not None

    def sample(self, strategy, prompt_ids, n, seed, inputs, own=None):
        from appo_trl.trainer.environments import generate_with_environments

        return generate_with_environments(self.trainer, strategy, prompt_ids, n, seed, inputs, self.runner.engine, own)

    def background_job(self, strategy, inputs, n, seed):
        """A background round gets instances of its own, built from the factories and reset here (TRL resets its
        pooled ones on this thread for the round it scores, so the round's thread never touches those)."""
        from appo_trl.trainer.environments import own_instances, own_prompt_ids, share_group_tasks

        own = own_instances(self.trainer, inputs)
        share_group_tasks(self.trainer, strategy, own.prompts, n, own)  # environment-owned data, branching
        prompt_ids = own_prompt_ids(self.trainer, own)
        return lambda: self.sample(strategy, prompt_ids, n, seed, inputs, own)

    def prepare(self, strategy, prompts, n):
        """Environment-owned data (TRL's IncrementEnv pattern): one task per group when branching."""
        from appo_trl.trainer.environments import share_group_tasks

        share_group_tasks(self.trainer, strategy, prompts, n)

    def hand_over(self, rnd, mode, prompts):
        """A background round's rows keep their own instances for TRL's reward step, and TRL's prompts become the
        ones the rows were sampled on (its reward functions and logs read them)."""
        handed, rnd.environments = rnd.environments, None
        if handed is not None:
            self.trainer.environments, prompts[:] = handed

    def stream_prompt_ids(self, prompts):
        return [[] for _ in prompts]  # the prompts reset() gives: rendered when a group starts (`start_group`)

    def start_group(self, group, n):
        """The group's n rows get instances of their own, `reset()` here with their rows as TRL resets its pool, and
        sample with them (`RolloutEngine.rollout(environments=)`) while other groups sample on theirs."""
        from appo_trl.trainer import environments

        t, engine, seed = self.trainer, self.runner.engine, group.seed
        own = environments.own_instances(t, group.inputs)
        prompt_ids = environments.own_prompt_ids(t, own)
        envs, per_row = environments.round_environments(t, prompt_ids, n, self.runner.strategy, group.inputs, own)
        group.prompt_ids = prompt_ids[0]

        async def env_group():  # per_row: reset() gave each row its own observation, sampled on its own (grpo)
            if per_row:
                rows = [g[0] for g in await engine.rollout(prompt_ids, 1, seed=seed, environments=envs)]
            else:
                rows = (await engine.rollout(prompt_ids[:1], n, seed=seed, environments=envs))[0]
            group.environments = HandedEnvironments(envs.rows(rows), own.prompts)  # before the future is done
            return rows

        return engine.submit(env_group())

    def stream_round(self, rnd, groups):
        """The rows' own instances and prompts, for TRL's reward step (`hand_over`)."""
        rnd.environments = HandedEnvironments([e for g in groups for e in g.environments.instances],
                                              [p for g in groups for p in g.environments.prompts])  # fmt: skip


class Agent(SamplingPath):
    """The user's agent through the endpoint: n runs per prompt, branches by replay (`AgentRounds`)."""

    name, streams = "agent", True
    reshapes_rows = True  # a run's other chains join it after the advantages (`chain_rows`)

    @classmethod
    def serves(cls, given: Given) -> bool:
        return given.agent is not None

    def bind(self, runner) -> SamplingPath:
        from appo_trl.trainer.agents import AgentRounds

        super().bind(runner)
        self.agents = AgentRounds(self.trainer, self.trainer.agent)
        return self

    def sample(self, strategy, prompt_ids, n, seed, inputs):
        return self.agents.generate(strategy, prompt_ids, n, seed, inputs)

    def hand_over(self, rnd, mode, prompts):
        self.agents.report(rnd, mode)  # the round's agent/* metrics; the failed-round collective

    def start_group(self, group, n):
        """n runs of the user's agent through the endpoint (`AgentRounds.start_group`)."""
        future, group.agent = self.agents.start_group(group.inputs, group.prompt_ids, n, group.seed)
        return future

    def stream_round(self, rnd, groups):
        """The groups' agent/* counts, summed once, for `hand_over`'s report."""
        rnd.agent = self.agents.round_report([g.agent for g in groups])

    def completions(self, rows, texts, prompts):
        return [r.messages for r in rows]  # the agent's conversation after its prompt (assistant, tool/user, ...)

    def extra_fields(self, rows):
        return {**super().extra_fields(rows), "agent_reward": [r.agent_reward for r in rows]}

    def tool_metrics(self, metrics, rows):
        """The agent runs its own tools: `tools/calls` counts the calls its model made (its rows')."""
        return {**metrics, "tools/calls": float(sum(int(r.num_calls) for r in rows))}

    def after_scoring(self, out, rnd, keep):
        """Each run's other chains join it as rows of their own, with its advantage (`chain_rows`)."""
        from appo_trl.trainer.chain_rows import add_chain_rows

        return add_chain_rows(self.trainer, out, rnd.rows, keep)

    def close(self):
        self.agents.close()  # agents cancelled, endpoint stopped (a later train() restarts it)


# checked in this order: the first path that serves `Given` samples its rounds
PATHS: dict[str, type[SamplingPath]] = {cls.name: cls for cls in (Agent, TRLSampler, Environments, ToolLoop)}


def resolve_path(given: Given) -> type[SamplingPath]:
    """The class of the path that serves `given`; ValueError (one line from `REFUSALS`) for what it cannot honour,
    and for a `rollout_engine=` that is not a `Sampler`."""
    path = next(cls for cls in PATHS.values() if cls.serves(given))
    reason = refusal(path.name, given)
    if reason is not None:
        raise ValueError(reason)
    missing = [] if given.rollout_engine is None else missing_members(given.rollout_engine, Sampler)
    if missing:
        raise ValueError(f"rollout_engine={type(given.rollout_engine).__name__} lacks {', '.join(missing)} of the "
                         "Sampler protocol (appo_trl.sampling.Sampler: rollout, branch_many, run, config, "
                         "replays_branches)")  # fmt: skip
    return path


__all__ = ["PATHS", "REFUSALS", "SETTINGS", "Agent", "Environments", "Given", "SamplingPath", "TRLSampler",
           "ToolLoop", "refusal", "resolve_path"]  # fmt: skip
