"""`RolloutEngine`: the async multi-turn tool loop, in-loop forking with group caps and refill, and branching.

Every trajectory is its own asyncio task: it samples until a tool stop tag, EOS or its budget, runs the call(s)
(`appo_trl.rollout.tool_turns`), appends the results as token ids (mask 0) and samples again, with no barrier
between trajectories. Sampled ids stay exactly as the backend returned them (nothing is re-tokenised) and
`len(prompt) + len(completion) <= max_model_len` always. The token rules, the two tool formats and environments
are in docs/architecture.md, "The rollout engine".

What it does not do: decide *whether* to branch (the algorithms layer passes a hook or positions in), score
rewards, or sync weights.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import hashlib
import inspect
import math
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from appo_trl.rollout.environments import RoundEnvironments
from appo_trl.rollout.text import (
    PieceDecoder,
    StopMatcher,
    topk_entropy,
    window_entropy,
)
from appo_trl.rollout.tool_turns import ToolTurns
from appo_trl.rollout.types import (
    Backend,
    BranchContext,
    Origin,
    RolloutConfig,
    SamplingParams,
    Segment,
    Trajectory,
)
from appo_trl.tools.base import Tool
from appo_trl.tools.executor import ToolExecutor
from appo_trl.tools.main_thread import MAIN_THREAD

T = TypeVar("T")
# the environments one `rollout(environments=...)` call samples on, seen by its trajectories' tasks
_CALL_ENVIRONMENTS = contextvars.ContextVar[RoundEnvironments | None]("appo_call_environments", default=None)
_CHAT_TURN = "<chat turn>"  # chat format: the pending "tag" of a closed assistant turn holding calls
Hook = Callable[[BranchContext], "int | Awaitable[int]"]


def mix_seed(*parts: Any) -> int:
    """A deterministic 63-bit seed from any hashable parts (distinct parts give distinct seeds in practice)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclasses.dataclass
class _Group:
    index: int
    prompt_ids: list[int]
    target: int
    seed: int
    route_key: str = ""  # the routing key of the group's trajectories
    created: int = 0
    active: int = 0
    trajectories: list[Trajectory] = dataclasses.field(default_factory=list)
    # fork points parked until every active trajectory of the group is parked (`_fork_point`)
    parked: list[tuple[Trajectory, int, float, float | None, asyncio.Future]] = dataclasses.field(default_factory=list)
    deciding: bool = False


class _Run:
    """Tasks of one `rollout`/`branch_many` call."""

    def __init__(self):
        self.tasks: set[asyncio.Task] = set()


class RolloutEngine(ToolTurns):
    """Samples tool-using trajectories from a `Backend`.

    Args:
        backend: the sampler (`VLLMServerBackend`, `TransformersBackend`, or any `Backend`).
        tokenizer: the policy's tokenizer (decoding tool calls, tokenising results, EOS id, vocabulary size).
        config: a `RolloutConfig`.
        tools: tools keyed by tag (chat format: by function name), or a `ToolExecutor` (its metrics are merged
            into `metrics()`).
        chat: a `ChatToolFormat` for `tool_format: chat`; None runs ARPO's tag format.

    A `Sampler` (`appo_trl.sampling`): its rows are sampled live, so a strategy's in-loop branch rule runs as `hook`.
    """

    replays_branches = False

    def __init__(self, backend: Backend, tokenizer, config: RolloutConfig | None = None,
                 tools: dict[str, Tool] | ToolExecutor | None = None, chat=None):  # fmt: skip
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = config or RolloutConfig()
        self.chat = chat
        self.stop_strings = list(chat.stop_strings) if chat is not None else self.config.stop_strings
        self.executor = tools if isinstance(tools, ToolExecutor) else ToolExecutor(dict(tools or {}))
        # TRL's `environment_factory`: one instance per trajectory, set for a round (or one call's: `environments=`)
        self.environments: RoundEnvironments | None = None
        self.decoder = PieceDecoder(tokenizer)
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id")
        self.eos_id = int(tokenizer.eos_token_id)
        self._special_ids = set(getattr(tokenizer, "all_special_ids", None) or []) - set(
            tokenizer(self.config.result_template, add_special_tokens=False)["input_ids"]
        )
        self._entropy_norm = math.log(len(tokenizer)) if self.config.entropy_normalize else 1.0
        pre, _, post = self.config.result_template.partition("{result}")
        self._tmpl_pre, self._tmpl_post = pre, post
        self._sems: dict[int, asyncio.Semaphore] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.reset_metrics()

    # ------------------------------------------------------------------ public API
    def environments_now(self) -> RoundEnvironments | None:
        """The environments of the trajectory being sampled: its `rollout` call's (`environments=`), else the round's."""
        own = _CALL_ENVIRONMENTS.get()
        return own if own is not None else self.environments

    async def rollout(self, prompts: list[list[int]], n: int | list[int], *, seed: int, hook: Hook | None = None,
                      group_size: int | list[int] | None = None,
                      route_seed: int | None = None,
                      environments: RoundEnvironments | None = None) -> list[list[Trajectory]]:  # fmt: skip
        """Sample `n` trajectories per prompt (all concurrently) and return them per prompt, in creation order.

        With `hook`, after each tool result the hook returns how many copies to fork at that point; each group
        is capped at `group_size` (default `n`) and refilled from the bare prompt whenever it has no active
        trajectory left, so every group ends with exactly `group_size` trajectories.

        Each group's trajectories share one routing key (`Trajectory.route_key`, the key that keeps a group on one
        vLLM replica), derived from `route_seed` (default `seed`). A side rollout for the same groups, such as
        AEPO's entropy probe, passes the round's seed as `route_seed` so that its prompts go to the same replicas.

        `environments`: this call's own (groups: its prompts), when calls sample concurrently on different instances
        (streamed groups); its tasks, forks included, see them through a context variable. Default: the round's.
        """
        ns = [n] * len(prompts) if isinstance(n, int) else list(n)
        sizes = (
            ns
            if group_size is None
            else [group_size] * len(prompts)
            if isinstance(group_size, int)
            else list(group_size)
        )
        if len(ns) != len(prompts) or len(sizes) != len(prompts):
            raise ValueError("n and group_size must be ints or lists as long as prompts")
        if any(s < k or k < 1 for k, s in zip(ns, sizes)):
            raise ValueError("need 1 <= n <= group_size for every prompt")
        for p in prompts:
            if not p or len(p) >= self.config.max_model_len:
                raise ValueError(f"prompt of {len(p)} tokens does not fit max_model_len={self.config.max_model_len}")
        start, run = time.perf_counter(), _Run()
        route_seed = seed if route_seed is None else route_seed
        groups = [_Group(i, list(p), sizes[i], mix_seed(seed, i), f"{mix_seed(route_seed, i):016x}")
                  for i, p in enumerate(prompts)]  # fmt: skip
        token = None if environments is None else _CALL_ENVIRONMENTS.set(environments)  # the tasks copy it
        try:
            for g, k in zip(groups, ns):
                for _ in range(k):
                    self._start_root(run, g, hook, origin=Origin.ROOT)
            while run.tasks:
                done, _ = await asyncio.wait(run.tasks, return_when=asyncio.FIRST_COMPLETED)
                run.tasks.difference_update(done)
                for task in done:  # every error of this wake-up is retrieved; the first one is raised
                    _ = task.cancelled() or task.exception()
                for task in done:
                    task.result()
                for g in groups:
                    if g.active == 0 and g.created < g.target:
                        self._m["refills"] += 1
                        self._start_root(run, g, hook, origin=Origin.REFILL)
        except BaseException:
            for task in run.tasks:
                task.cancel()
            await asyncio.gather(*run.tasks, return_exceptions=True)
            raise
        finally:
            self._m["wall_time_s"] += time.perf_counter() - start
            if token is not None:
                _CALL_ENVIRONMENTS.reset(token)
        return [g.trajectories for g in groups]

    async def branch(self, parent: Trajectory, position: int, *, seed: int, resample: bool = True) -> Trajectory:
        """Continue a new trajectory from `prompt + parent.completion[:position]` with the same tool loop.

        `resample=True` re-samples token `position` onward; `resample=False` keeps token `position` and samples
        from `position + 1`. The prefix's ids, masks, logprobs, entropies and tool calls are copied exactly
        and the call counter starts from the prefix's calls. A prefix that ends right after a tool stop tag
        re-runs that call; a prefix may not end inside a tool result.
        """
        start = time.perf_counter()
        try:
            return await self._branch(parent, position, seed=seed, resample=resample)
        finally:
            self._m["wall_time_s"] += time.perf_counter() - start

    async def branch_many(self, requests: list[tuple[Trajectory, int]], *, seed: int,
                          resample: bool = True) -> list[Trajectory]:  # fmt: skip
        """`branch` for many `(parent, position)` pairs concurrently; results in request order."""
        start = time.perf_counter()
        try:
            return list(await asyncio.gather(*(
                self._branch(p, pos, seed=mix_seed(seed, "branch", i), resample=resample)
                for i, (p, pos) in enumerate(requests)
            )))  # fmt: skip
        finally:
            self._m["wall_time_s"] += time.perf_counter() - start

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the engine's own event-loop thread and return its result (blocking).

        Safe to call repeatedly and from any thread, including one that already runs an event loop; not from
        a coroutine running on the engine's loop itself (await there instead).
        """
        loop = self._ensure_loop()
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("RolloutEngine.run() called from the engine's own loop; await the coroutine instead")
        # the main thread runs the calls of tools that use signals while it waits (tools.main_thread)
        return MAIN_THREAD.wait(asyncio.run_coroutine_threadsafe(coro, loop))

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future:
        """Schedule a coroutine on the engine's loop from another thread (the agent endpoint's backend calls)."""
        return asyncio.run_coroutine_threadsafe(coro, self._ensure_loop())

    def close(self) -> None:
        """Close the backend's and tools' connections and stop the engine's loop thread (idempotent)."""
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None:
            return

        async def _shutdown():
            for obj in (self.backend, self.executor):
                closer = getattr(obj, "aclose", None)
                if closer is not None:
                    await closer()
            current = asyncio.current_task()
            others = [t for t in asyncio.all_tasks() if t is not current]
            for t in others:
                t.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(_shutdown(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()

    def metrics(self) -> dict[str, float]:
        """Rollout and tool metrics since the last `reset_metrics()` (keys `rollout/*` and `tools/*`)."""
        m = self._m
        out = {f"rollout/{k}": float(v) for k, v in sorted(m.items())}
        out["rollout/tokens_per_s"] = m["tokens_sampled"] / m["wall_time_s"] if m["wall_time_s"] else 0.0
        for tag, s in sorted(self._tool_m.items()):
            for key, val in s.items():
                out[f"rollout/tool/{tag}/{key}"] = float(val)
        out.update(self.executor.metrics())
        backend_metrics = getattr(self.backend, "metrics", None)  # replicas/* behind a router
        if callable(backend_metrics):
            out.update(backend_metrics())
        return out

    def reset_metrics(self) -> None:
        self._m: dict[str, float] = defaultdict(float)
        for key in ("tokens_sampled", "prefix_tokens_reused", "tool_calls", "tool_failures", "tool_time_s",
                    "generation_time_s", "wall_time_s", "requests", "call_limit_hits", "length_hits",
                    "empty_calls", "trajectories", "forks", "refills", "branches"):  # fmt: skip
            self._m[key] = 0.0
        self._tool_m: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "failures": 0, "time_s": 0.0})
        if hasattr(self.executor, "reset_metrics"):
            self.executor.reset_metrics()

    # ------------------------------------------------------------------ internals

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="appo-rollout-loop", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def _semaphore(self) -> asyncio.Semaphore:
        key = id(asyncio.get_running_loop())
        if key not in self._sems:
            self._sems[key] = asyncio.Semaphore(self.config.concurrency)
        return self._sems[key]

    def _budget(self, traj: Trajectory) -> int:
        c = len(traj.completion_ids)
        return min(self.config.max_completion_length - c, self.config.max_model_len - len(traj.prompt_ids) - c)

    def _start_root(self, run: _Run, group: _Group, hook: Hook | None, origin: Origin) -> None:
        traj = Trajectory(prompt_ids=list(group.prompt_ids), group=group.index,
                          entropies=[] if (hook is not None or self.config.record_entropies) else None)  # fmt: skip
        # the routing key: one per prompt group of one round, kept by forks, refills and branches
        traj.origin, traj.seed, traj.route_key = origin, mix_seed(group.seed, group.created), group.route_key
        if (envs := self.environments_now()) is not None:
            envs.start(traj)
        self._register(run, group, traj, hook)

    def _register(self, run: _Run, group: _Group | None, traj: Trajectory, hook: Hook | None,
                  pending_tag: str | None = None) -> asyncio.Task:  # fmt: skip
        if group is not None:
            group.created += 1
            group.active += 1
            group.trajectories.append(traj)
        self._m["trajectories"] += 1
        task = asyncio.get_running_loop().create_task(self._loop_traj(run, group, traj, hook, pending_tag))
        run.tasks.add(task)
        return task

    async def _sample(self, traj: Trajectory, max_tokens: int) -> Segment:
        cfg = self.config
        seed = mix_seed(traj.seed, len(traj.request_seeds))
        traj.request_seeds.append(seed)
        params = SamplingParams(max_tokens=max_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                seed=seed, stop=self.stop_strings,
                                logprobs=cfg.entropy_topk if traj.entropies is not None else 0,
                                session_id=traj.route_key)  # fmt: skip
        async with self._semaphore():
            start = time.perf_counter()
            seg = await self.backend.generate(traj.prompt_ids + traj.completion_ids, params)
            self._m["generation_time_s"] += time.perf_counter() - start
        if len(seg.token_ids) > max_tokens:
            raise RuntimeError(f"backend returned {len(seg.token_ids)} tokens for max_tokens={max_tokens}")
        self._m["requests"] += 1
        self._m["tokens_sampled"] += len(seg.token_ids)
        return seg

    def _append_segment(self, traj: Trajectory, seg: Segment) -> list[float] | None:
        ents = None
        if traj.entropies is not None:
            tops = seg.top_logprobs or [None] * len(seg.token_ids)
            ents = [topk_entropy(t) for t in tops]
        versions = [v for v, n in seg.version_runs for _ in range(n)] if seg.version_runs else None
        traj.append(seg.token_ids, 1, list(seg.logprobs), ents, versions)
        if traj.entropies is not None and traj.root_entropy is None:
            traj.root_entropy = self._window(ents)
        return ents

    def _window(self, ents: list[float] | None) -> float:
        if not ents:
            return math.nan
        return window_entropy(ents, self.config.entropy_window, self.config.entropy_reduce, self._entropy_norm)

    async def _fork_point(self, run: _Run, group: _Group, traj: Trajectory, hook: Hook,
                          segment_entropy: float) -> Segment | None:  # fmt: skip
        """Park at a fork point until the group's hook has decided it; returns the look-ahead segment, if any.

        The hook decides the parked fork points of a group only once every active trajectory of the group is
        parked or finished, in the group's creation order (the round-synchronous order of the released sampler),
        so which trajectory gets the group's last slots never depends on which reached its tool call first.
        """
        position, look, look_entropy = len(traj.completion_ids), None, None
        if self.config.hook_mode == "lookahead":
            budget = self._budget(traj)
            if budget <= 0:
                return None
            look = await self._sample(traj, min(self.config.entropy_window, budget))
            tops = look.top_logprobs or [None] * len(look.token_ids)
            look_entropy = self._window([topk_entropy(t) for t in tops])
        decided = asyncio.get_running_loop().create_future()
        group.parked.append((traj, position, segment_entropy, look_entropy, decided))
        await self._decide_parked(run, group, hook)
        await decided
        return look

    async def _decide_parked(self, run: _Run, group: _Group, hook: Hook | None) -> None:
        """Run the hook on the group's parked fork points once all its active trajectories are parked."""
        while hook is not None and not group.deciding and group.parked and len(group.parked) == group.active:
            group.deciding = True
            order = {id(t): i for i, t in enumerate(group.trajectories)}
            batch, group.parked = sorted(group.parked, key=lambda e: order[id(e[0])]), []
            try:
                for traj, position, segment_entropy, look_entropy, decided in batch:
                    await self._fork(run, group, traj, hook, position, segment_entropy, look_entropy)
                    decided.set_result(None)
            except BaseException as exc:
                for *_, decided in batch:
                    if not decided.done():
                        decided.set_exception(exc)
                raise
            finally:
                group.deciding = False

    async def _fork(self, run: _Run, group: _Group, traj: Trajectory, hook: Hook, position: int,
                    segment_entropy: float, look_entropy: float | None) -> None:  # fmt: skip
        ctx = BranchContext(traj, position, segment_entropy, math.nan if traj.root_entropy is None else traj.root_entropy, look_entropy,
                            group.created, group.target, group.active)  # fmt: skip
        want = hook(ctx)
        if inspect.isawaitable(want):
            want = await want
        copies = max(0, min(int(want), group.target - group.created))
        for k in range(copies):
            child = traj.prefix_copy(position)
            # keyed on the lineage (parent, fork point, copy), never on the order of creation
            child.origin, child.seed = Origin.FORK, mix_seed(traj.seed, "fork", position, k)
            if (envs := self.environments_now()) is not None:
                await envs.fork(child, traj)
            self._m["forks"] += 1
            self._m["prefix_tokens_reused"] += position
            self._register(run, group, child, hook)

    async def _loop_traj(self, run: _Run, group: _Group | None, traj: Trajectory, hook: Hook | None,
                         pending_tag: str | None) -> None:  # fmt: skip
        try:
            next_seg: Segment | None = None
            while traj.finish_reason == "running":
                segment_entropy = math.nan
                if pending_tag is None:
                    if next_seg is None:
                        budget = self._budget(traj)
                        if budget <= 0:
                            traj.finish_reason = "length"
                            self._m["length_hits"] += 1
                            break
                        next_seg = await self._sample(traj, budget)
                    seg, next_seg = next_seg, None
                    segment_entropy = self._window(self._append_segment(traj, seg))
                    if seg.finish_reason == "eos":
                        if self.chat is None or not self.chat.has_calls(self._turn_text(traj)):
                            traj.finish_reason = "eos"
                            break
                        tag = _CHAT_TURN  # chat: the turn ended with calls in it
                    elif seg.finish_reason == "length" or seg.stop_str not in self.stop_strings:
                        continue  # the budget check at the top ends it when nothing is left
                    else:
                        tag = self._stop_tag(seg.stop_str)
                else:
                    tag, pending_tag = pending_tag, None
                if not await self._call_tool(traj, tag):
                    break
                if hook is not None and group is not None:
                    next_seg = await self._fork_point(run, group, traj, hook, segment_entropy)
        finally:
            if group is not None:
                group.active -= 1
        if group is not None:  # the siblings parked at their fork points may be waiting only for this one
            await self._decide_parked(run, group, hook)
        traj.check()

    @staticmethod
    def _stop_tag(stop: str) -> str:
        """The tool tag of a tag-format stop string (`</python>` -> `python`); chat format has no stop strings."""
        return stop[2:-1]

    def _pending_tag(self, traj: Trajectory) -> str | None:
        """The tool tag whose stop string the prefix's last sampled token completes, if any (chat: the prefix
        ends with a sampled end of turn and the turn holds calls)."""
        if not traj.completion_ids or traj.loss_mask[-1] != 1:
            return None
        if self.chat is not None:
            last = traj.completion_ids[-1]
            ended = last == self.eos_id or [last] == self.chat.turn_end_ids
            return _CHAT_TURN if ended and self.chat.has_calls(self._turn_text(traj)) else None
        matcher, longest = StopMatcher(self.stop_strings), max(map(len, self.stop_strings), default=0)
        stop = None
        for tok in traj.completion_ids[-(longest + 1) :]:
            stop = matcher.push(self.decoder.piece(tok))
        return self._stop_tag(stop) if stop else None

    async def _branch(self, parent: Trajectory, position: int, *, seed: int, resample: bool) -> Trajectory:
        p = position if resample else position + 1
        if not 0 <= p <= len(parent.completion_ids) or (not resample and position < 0):
            raise ValueError(f"branch position {position} outside a completion of {len(parent.completion_ids)} tokens")
        for call in parent.tool_calls:
            if call.start < p < call.end:
                raise ValueError(f"branch position {p} falls inside the result of tool call {call.tag!r} "
                                 f"(tokens {call.start}..{call.end})")  # fmt: skip
        child = parent.prefix_copy(p)
        child.origin, child.seed = Origin.BRANCH, mix_seed(seed, p, len(parent.completion_ids))
        if (envs := self.environments_now()) is not None:
            await envs.fork(child, parent)
        self._m["branches"] += 1
        self._m["prefix_tokens_reused"] += p
        pending = self._pending_tag(child)
        if pending is None and p and child.completion_ids[-1] == self.eos_id:
            child.finish_reason = "eos" if child.loss_mask[-1] else parent.finish_reason
            self._m["trajectories"] += 1
            return child
        run = _Run()
        task = self._register(run, None, child, None, pending_tag=pending)
        await task
        return child
