"""Per-trajectory environments (TRL's `environment_factory`) inside the rollout engine, branches included.

TRL's `GRPOTrainer(environment_factory=...)` gives every rollout its own environment instance: `reset(**row)`
is called once before generation, the instance's public methods are the rollout's tools, and an optional
`get_reward()` scores the finished rollout from the instance's state. This module keeps that contract when
trajectories are forked (ARPO/AEPO, inside the tool loop) or branched from a prefix (APPO, after the fact):
every trajectory owns one instance, and a child starts from an instance in its parent's state *at the fork*,
i.e. after the parent's first k tool calls (k = the calls whose results lie in the shared prefix). Two ways,
chosen per environment class (`branch_mode`):

- `"deepcopy"` (the default when `copy.deepcopy(instance)` works): a snapshot is deep-copied after `reset()`
  and after every environment call of every trajectory that may be branched later (`snapshots=True`, APPO),
  keyed by the number of tool-call records it follows; forks made right after a turn (ARPO/AEPO) deep-copy the
  parent's live instance, which is in exactly that state.
- `"replay"` (declared on the class: `branch_mode = "replay"`): a fresh instance from the factory is `reset()`
  with the same row and the parent's first k environment calls are re-executed in order. Each replayed result
  must equal the recorded one; a difference (a non-deterministic environment) raises instead of continuing
  from a wrong state.

Several calls in one assistant turn: the engine runs the calls of one turn that go to the trajectory's
environment one at a time, in call order (they may mutate its state; TRL runs sync tools the same way), and
passes each call's record index to `record` explicitly, since the records of a turn are appended only when all
of its calls are done. Standalone tools of the same turn still run concurrently.

`branch_mode(instance)` decides at start-up and raises one clear error for an environment that can do
neither. What this module does not do: create the environments of a batch or call `reset()` on them (TRL's
`_generate_and_score_completions` does; `RoundEnvironments` receives them), call `get_reward()` (TRL's reward
step does, on the instances `RoundEnvironments.rows` returns), or parse tool calls (the engine does).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from appo_trl.tools.callables import FunctionTool

BRANCH_MODES = ("deepcopy", "replay")
_NOT_TOOLS = ("reset", "get_reward")


def environment_methods(env: Any) -> dict[str, Callable]:
    """The instance's tools, as TRL picks them: public functions defined on its class except `reset` and
    `get_reward` (properties are never evaluated), bound to `env`, by name."""
    return {
        name: getattr(env, name)
        for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
        if name not in _NOT_TOOLS and not name.startswith("_")
    }


def branch_mode(env: Any, strategy: str = "arpo") -> str:
    """How a branch of a rollout on `env` gets its parent's state: the class's `branch_mode` when declared,
    else `"deepcopy"` when a deep copy of `env` succeeds; ValueError (one line, naming the class) otherwise."""
    name = type(env).__name__
    declared = getattr(env, "branch_mode", None)
    if declared is not None:
        if declared not in BRANCH_MODES:
            raise ValueError(f"environment {name}: branch_mode={declared!r}; valid: {', '.join(BRANCH_MODES)}")
        return declared
    try:
        copy.deepcopy(env)
    except Exception as exc:  # noqa: BLE001 - any failure means "cannot be copied"
        raise ValueError(
            f"environment {name} cannot be deep-copied ({type(exc).__name__}: {exc}), so rollout_strategy={strategy} "
            f'cannot give a branch its parent\'s environment state; declare `branch_mode = "replay"` on {name} if '
            "reset() plus the parent's tool calls reproduce the state, or use rollout_strategy: grpo"
        ) from None
    return "deepcopy"


@dataclass
class _Call:
    index: int  # position of this call among the trajectory's tool-call records
    name: str
    arguments: str  # JSON object text, as the model wrote it
    result: str  # the tool's text before it was spliced into the trajectory


@dataclass
class _State:
    env: Any
    group: int
    tools: dict[str, FunctionTool]
    calls: list[_Call] = field(default_factory=list)  # environment calls, in order
    snapshots: dict[int, Any] | None = None  # snapshots[k]: the instance after k tool-call records (env calls only)


class RoundEnvironments:
    """The environments of one generation round, one instance per trajectory (looked up by trajectory uid).

    Args:
        instances: per group (the engine's prompt index), the instances TRL created and `reset()` for this round's
            rows of that prompt, in row order; roots take them in creation order.
        make: per group, a callable returning a fresh instance already `reset()` with that group's row (for roots
            beyond `instances` and for `replay` branches).
        modes: per group, `"deepcopy"`, `"replay"`, or None when trajectories of that group are never branched.
        snapshots: keep a deep copy after every call of `deepcopy` groups (needed when branches are made after
            the parent has moved on, as APPO does).
        timeouts: per method name, the deadline of one call in seconds (`tool_config: {method: {timeout: s}}`);
            other methods get the executor's default, as tools do; a call past it is abandoned like a tool's.
    """

    def __init__(self, instances: Sequence[Sequence[Any]], make: Sequence[Callable[[], Any]],
                 modes: Sequence[str | None], snapshots: bool = False,
                 timeouts: dict[str, float] | None = None):  # fmt: skip
        if not len(instances) == len(make) == len(modes):
            raise ValueError("instances, make and modes need one entry per group")
        self._free = [list(group) for group in instances]
        self._make, self._modes, self._snapshots = list(make), list(modes), snapshots
        self._timeouts = dict(timeouts or {})  # method name -> deadline of one call (else the executor's default)
        self._states: dict[str, _State] = {}
        self._templates: dict[tuple[type, str], FunctionTool] = {}

    # ---- instances ---------------------------------------------------------------------------------------------
    def start(self, traj) -> None:
        """Give a new root trajectory its instance: the group's next reset instance, else a fresh one."""
        free = self._free[traj.group]
        env = free.pop(0) if free else self._make[traj.group]()
        self._register(traj, env)

    async def fork(self, child, parent) -> None:
        """Give `child` (a prefix copy of `parent`) an instance in the parent's state after `child.num_calls` calls."""
        state = self._states.get(parent.uid)
        if state is None:
            raise RuntimeError(f"trajectory {parent.uid} has no environment to branch from")
        mode, k = self._modes[state.group], child.num_calls
        if mode is None:
            raise RuntimeError("this round's environments were not set up for branching")
        if mode == "deepcopy":
            if state.snapshots is not None and any(j <= k for j in state.snapshots):
                # the state after k records is the one after the last environment call among them (other tools'
                # records leave it unchanged)
                env = copy.deepcopy(state.snapshots[max(j for j in state.snapshots if j <= k)])
            elif state.snapshots is None and self._records(parent) == k:
                env = copy.deepcopy(state.env)  # forked right after its k-th call: the live state is the state at k
            else:
                raise RuntimeError(f"no environment snapshot after {k} calls of trajectory {parent.uid}")
        else:
            env = await self._replay(state, k)
        self._register(child, env, [c for c in state.calls if c.index < k])

    async def _replay(self, state: _State, k: int) -> Any:
        env = self._make[state.group]()
        tools = self._tools_of(env)
        for call in (c for c in state.calls if c.index < k):
            result = await tools[call.name].call(call.arguments)
            if result.text != call.result:
                raise RuntimeError(
                    f"environment {type(env).__name__} (branch_mode='replay'): replaying call {call.index + 1} "
                    f"{call.name}({call.arguments}) returned {result.text[:200]!r}, the parent got "
                    f"{call.result[:200]!r}; the environment is not deterministic given reset() and its calls, "
                    "so its branches would start from a wrong state (use branch_mode='deepcopy')"
                )
        return env

    def _register(self, traj, env: Any, calls: list[_Call] | None = None) -> None:
        snaps = None
        if self._snapshots and self._modes[traj.group] == "deepcopy":
            snaps = {self._records(traj): copy.deepcopy(env)}  # a child never forks before its prefix
        self._states[traj.uid] = _State(env, traj.group, self._tools_of(env), list(calls or []), snaps)

    @staticmethod
    def _records(traj) -> int:
        return len(traj.tool_calls)

    def _tools_of(self, env: Any) -> dict[str, FunctionTool]:
        out = {}
        for name, method in environment_methods(env).items():
            key = (type(env), name)
            if key not in self._templates:
                self._templates[key] = FunctionTool(method, call_timeout_s=self._timeouts.get(name))  # schema once
            tool = copy.copy(self._templates[key])
            tool.func = method
            out[name] = tool
        return out

    # ---- tool calls --------------------------------------------------------------------------------------------
    def tool(self, traj, name: str) -> FunctionTool | None:
        """The trajectory's own bound method `name` as a tool, or None when its environment has no such tool."""
        state = self._states.get(traj.uid)
        return None if state is None else state.tools.get(name)

    def record(self, traj, index: int, name: str, arguments: str, result: str) -> None:
        """Note an environment call the engine just ran for `traj`, which becomes its tool-call record `index`
        (passed in: a multi-call turn appends its records after all of its calls ran), and snapshot the instance
        (the state after `index + 1` records) when branches may need it. Calls are noted in call order."""
        state = self._states[traj.uid]
        if state.calls and index <= state.calls[-1].index:
            raise RuntimeError(
                f"environment call {index} of trajectory {traj.uid} noted after call {state.calls[-1].index}"
            )
        state.calls.append(_Call(index, name, arguments, result))
        if state.snapshots is not None:
            state.snapshots[index + 1] = copy.deepcopy(state.env)

    # ---- results -----------------------------------------------------------------------------------------------
    def env_of(self, traj) -> Any:
        return self._states[traj.uid].env

    def rows(self, trajectories: Sequence[Any]) -> list[Any]:
        """The instance of each trajectory, in order (what TRL's `get_reward` and reward functions receive)."""
        return [self.env_of(t) for t in trajectories]
