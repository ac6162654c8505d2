"""Streaming rollouts (`rollout_stream: true`): groups sample continuously, and a generation batch is the oldest
complete groups within the staleness bound.

`GroupStream` is fed TRL's generation batches (a group = the n rows of one prompt) and keeps at most `max_groups`
groups held at once, sampling or complete (the buffer's bound: its memory is `buffer_bytes`). Each group samples
as one `start_group` call (the rollout engine's loop thread: no thread of its own); when one ends, the next one
fed starts. `take(num_groups, step)` hands over the oldest complete groups whose oldest sampled token is within
`max_staleness` (per token: `Trajectory.oldest_version`, else the version the group started under), waiting
(on the main thread, running its queued tool calls) while fewer are complete. A group is admitted or dropped as
one unit: a too-stale group is dropped whole and its prompt sampled again first. Unfinished groups carry over to
the next batch. Nothing here samples, syncs or scores. The rules: docs/streaming.md.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from appo_trl.strategies.record import HandedEnvironments
from appo_trl.tools.main_thread import MAIN_THREAD

logger = logging.getLogger(__name__)

# bytes per completion token held in the buffer: the id, the loss mask, the logprob, the version (Python ints and
# floats in lists: one 8-byte pointer each plus the object, ~ 4 x (8 + 28)) and a prompt token (pointer + int)
TOKEN_BYTES, PROMPT_TOKEN_BYTES = 144, 36


class StreamDry(RuntimeError):
    """`take` was asked for more groups than were fed and are still sampling or complete."""


@dataclass
class StreamGroup:
    """One prompt's group in the stream: TRL's n input rows, its prompt ids, seed and the rows once sampled."""

    order: int  # fed order (oldest first); a group sampled again keeps its order
    inputs: list[dict]
    prompt_ids: list[int]
    seed: int
    step: int = 0  # the optimizer step whose generation batch fed it (a checkpoint keeps the ones before it)
    version: int = -1  # the sampler's version when it started (the rows' versions when they record none)
    future: concurrent.futures.Future | None = None
    environments: HandedEnvironments | None = None  # environment_factory: its rows' own instances, once sampled
    agent: Any = None  # an agent path's group: its runs' `AgentEngine` (their agent/* counts)
    metrics: dict[str, float] | None = None  # a branching strategy's per-round metrics of this group's tree
    attempts: int = 0

    @property
    def done(self) -> bool:
        return self.future is not None and self.future.done()

    def rows(self) -> list[Any]:
        return self.future.result()

    def oldest_version(self) -> int:
        """The oldest policy version of any sampled token of the group (all its rows, chains included)."""
        found = [v for r in self._all_rows() if (v := r.oldest_version()) is not None]
        return min(found) if found else self.version

    def _all_rows(self) -> list[Any]:
        return [x for r in self.rows() for x in (r, *getattr(r, "chain_rows", ()))]

    def token_versions(self) -> list[int]:
        """Per sampled token of the group, its version (the group's start version where none are recorded)."""
        out = []
        for r in self._all_rows():
            versions = r.versions if r.versions is not None else [self.version] * len(r.loss_mask)
            out += [v for v, m in zip(versions, r.loss_mask) if m]
        return out

    def nbytes(self) -> int:
        rows = self._all_rows() if self.done and self.future.exception() is None else []
        return len(self.prompt_ids) * PROMPT_TOKEN_BYTES + sum(len(r.completion_ids) for r in rows) * TOKEN_BYTES


@dataclass
class StreamBatch:
    """What `take` hands over: the groups (oldest first), their TRL input rows, and the hand-over's figures."""

    groups: list[StreamGroup]
    inputs: list[dict]
    wait_s: float
    dropped_groups: int
    dropped_rows: int
    carried_groups: int  # groups still sampling or complete and left for a later batch
    staleness_mean: float  # per sampled token, at the batch's first optimizer step
    staleness_max: int
    buffer_bytes: int  # the groups held after the hand-over
    metrics: dict[str, float] = field(default_factory=dict)


class GroupStream:
    """The bounded group producer (module docstring).

    Args:
        start_group: `(group) -> Future` of the `StreamGroup`'s rows (one prompt, n rows: its `inputs`,
            `prompt_ids` and `seed`), scheduled on the sampler's own thread; called on the thread that feeds and
            takes (the trainer's), it must not block.
        version: `() -> int`, the sampler's current policy version (the version a group starts under).
        group_size: n, the rows of one group.
        max_groups: most groups held at once, sampling or complete (the buffer's bound).
        max_staleness: k: a group trains only while `step − oldest token version + m − 1 <= k`.
        steps_per_round: m, optimizer steps one generation batch trains.
        max_attempts: times one prompt is sampled again after a too-stale group before the run stops.
    """

    def __init__(self, start_group: Callable[[StreamGroup], concurrent.futures.Future], version: Callable[[], int],
                 *, group_size: int, max_groups: int, max_staleness: int, steps_per_round: int = 1,
                 max_attempts: int = 3):  # fmt: skip
        if max_groups < 1 or group_size < 1 or max_staleness < 0 or steps_per_round < 1:
            raise ValueError(f"GroupStream: max_groups={max_groups}, group_size={group_size}, max_staleness="
                             f"{max_staleness}, steps_per_round={steps_per_round} (need >= 1, >= 1, >= 0, >= 1)")  # fmt: skip
        self.start_group, self.version = start_group, version
        self.n, self.max_groups, self.k, self.m = group_size, max_groups, max_staleness, steps_per_round
        self.max_attempts = max_attempts
        self._lock = threading.Lock()
        self._queued: deque[StreamGroup] = deque()  # fed, not started
        self._held: list[StreamGroup] = []  # started: sampling or complete
        self._wake = concurrent.futures.Future()
        self._order = 0
        self.closed = False
        self.dropped_groups = self.dropped_rows = 0
        self.wait_s = 0.0

    # ---- feeding ------------------------------------------------------------------------------------------------
    def feed(self, inputs: list[dict], prompt_ids: list[list[int]], seeds: list[int], step: int = 0) -> None:
        """Queue TRL's rows `inputs` (n per prompt, in order; `prompt_ids` and `seeds` one per group), the generation
        batch of optimizer step `step`."""
        if len(inputs) != len(prompt_ids) * self.n or len(seeds) != len(prompt_ids):
            raise ValueError(f"GroupStream.feed: {len(inputs)} rows for {len(prompt_ids)} prompts of {self.n} rows "
                             f"and {len(seeds)} seeds")  # fmt: skip
        with self._lock:
            for g, (ids, seed) in enumerate(zip(prompt_ids, seeds)):
                rows = inputs[g * self.n : (g + 1) * self.n]
                if any(r.get("prompt") != rows[0].get("prompt") for r in rows):
                    raise ValueError(f"GroupStream.feed: rows {g * self.n}-{(g + 1) * self.n - 1} are not one "
                                     "prompt's group (TRL's sampler repeats each prompt n times in a row)")  # fmt: skip
                self._queued.append(StreamGroup(self._order, rows, list(ids), int(seed), int(step)))
                self._order += 1
        self._top_up()

    @property
    def queued(self) -> int:
        return len(self._queued)

    @property
    def held(self) -> int:
        return len(self._held)

    def in_flight(self) -> list[StreamGroup]:
        """Groups started and not yet complete."""
        with self._lock:
            return [g for g in self._held if not g.done]

    def buffer_bytes(self) -> int:
        with self._lock:
            return sum(g.nbytes() for g in self._held)

    def _top_up(self) -> None:
        starts = []
        with self._lock:
            while not self.closed and self._queued and len(self._held) < self.max_groups:
                group = self._queued.popleft()
                group.version, group.attempts = self.version(), group.attempts + 1
                self._held.append(group)
                starts.append(group)
        for group in starts:  # outside the lock: a future already done calls back at once
            group.future = self.start_group(group)
            group.future.add_done_callback(self._on_done)

    def _on_done(self, _future) -> None:
        with self._lock:
            wake, self._wake = self._wake, concurrent.futures.Future()
        wake.set_result(None)

    # ---- hand-over ----------------------------------------------------------------------------------------------
    def too_stale(self, group: StreamGroup, step: int) -> bool:
        return step - group.oldest_version() + self.m - 1 > self.k

    def take(self, num_groups: int, step: int, timeout_s: float | None = None) -> StreamBatch:
        """The `num_groups` oldest complete groups within the bound at `step`, removed from the stream."""
        start, dropped_groups, dropped_rows = time.perf_counter(), 0, 0
        while True:
            with self._lock:
                failed = next((g for g in self._held if g.done and g.future.exception() is not None), None)
                complete = sorted((g for g in self._held if g.done), key=lambda g: g.order)
                stale = [g for g in complete if failed is None and self.too_stale(g, step)]
                for g in stale:  # dropped whole: every row of the tree; its prompt is sampled again first
                    self._held.remove(g)
                    dropped_groups, dropped_rows = dropped_groups + 1, dropped_rows + len(g.rows())
                    self.dropped_groups, self.dropped_rows = self.dropped_groups + 1, self.dropped_rows + len(g.rows())
                    if g.attempts >= self.max_attempts:
                        raise RuntimeError(f"the group of prompt #{g.order} was too stale {g.attempts} times in a "
                                           f"row (max_staleness={self.k}): its tail outlasts the bound")  # fmt: skip
                    g.seed += 1_000_003  # a fresh draw, not the stale one again
                    self._queued.appendleft(g)
                fresh = [g for g in complete if g not in stale]
                taken = fresh[:num_groups] if failed is None and len(fresh) >= num_groups else None
                if taken is not None:
                    for g in taken:
                        self._held.remove(g)
                dry = failed is None and taken is None and len(self._held) + len(self._queued) < num_groups
                wake = self._wake
            if stale:
                logger.warning("dropping %d stale group(s) (%d rows) at step %d: their oldest tokens are over "
                               "max_staleness=%d; their prompts are sampled again", len(stale),
                               sum(len(g.rows()) for g in stale), step, self.k)  # fmt: skip
                self._top_up()
            if failed is not None:
                failed.future.result()  # raises the group's own failure
            if taken is not None:
                break
            if dry:
                raise StreamDry(f"a generation batch needs {num_groups} groups but only {self.held} are sampling "
                                f"or complete and {self.queued} queued")  # fmt: skip
            if timeout_s is not None and time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"fewer than {num_groups} groups completed within {timeout_s:g} s")
            try:  # the main thread runs the groups' signal-using tool calls meanwhile
                MAIN_THREAD.wait(wake, timeout=1.0)
            except concurrent.futures.TimeoutError:
                pass
        self._top_up()
        waited = time.perf_counter() - start
        self.wait_s += waited
        stale_tokens = [step - v for g in taken for v in g.token_versions()]
        batch = StreamBatch(
            groups=taken, inputs=[r for g in taken for r in g.inputs], wait_s=waited, dropped_groups=dropped_groups,
            dropped_rows=dropped_rows, carried_groups=self.held, buffer_bytes=self.buffer_bytes(),
            staleness_mean=sum(stale_tokens) / len(stale_tokens) if stale_tokens else 0.0,
            staleness_max=max(stale_tokens, default=0),
        )  # fmt: skip
        batch.metrics = {
            "rollout/staleness/token_mean": batch.staleness_mean, "rollout/staleness/token_max": float(batch.staleness_max),
            "rollout/stream/dropped_groups": float(dropped_groups), "rollout/stale_rows_dropped": float(dropped_rows),
            "rollout/stream/carried_groups": float(batch.carried_groups), "rollout/stream/wait_s": waited,
            "rollout/stream/buffer_bytes": float(batch.buffer_bytes),
        }  # fmt: skip
        return batch

    # ---- checkpoints, shutdown ----------------------------------------------------------------------------------
    def unfinished(self) -> list[StreamGroup]:
        """Every group fed and not handed over (sampling, complete or queued), oldest first."""
        with self._lock:
            return sorted([*self._held, *self._queued], key=lambda g: g.order)

    def carried_before(self, step: int) -> list[StreamGroup]:
        """The unfinished groups fed by the batches of steps before `step`: a resume at `step` would not feed them
        again (its data loader starts at `step`'s batch), oldest first."""
        return [g for g in self.unfinished() if g.step < step]

    def close(self) -> int:
        """Stop starting groups and cancel those in flight; the number of groups dropped unfinished."""
        with self._lock:
            self.closed = True
            held, self._held = self._held, []
            queued, self._queued = list(self._queued), deque()
        for g in held:
            if g.future is not None:
                g.future.cancel()
        return len(held) + len(queued)


@dataclass(frozen=True)
class CarriedGroup:
    """One group a checkpoint holds: TRL's n input rows, its prompt ids and seed (sampled again at the resume)."""

    inputs: list[dict]
    prompt_ids: list[int]
    seed: int


@dataclass(frozen=True)
class StreamCheckpoint:
    """What `rollout_stream` keeps in a checkpoint at `step` (`appo_sampler_state.json`, key "stream"): the groups
    carried over from the batches before `step`, oldest first. Those of later batches are not kept: the resumed
    data loader feeds their batches again. A group whose rows are not JSON is counted in `not_saved`."""

    step: int
    groups: list[CarriedGroup]
    not_saved: int = 0

    @classmethod
    def of(cls, stream: GroupStream | None, step: int) -> StreamCheckpoint:
        groups, not_saved = [], 0
        for g in stream.carried_before(step) if stream is not None else []:
            try:
                json.dumps(g.inputs)
            except (TypeError, ValueError):
                not_saved += 1
                continue
            groups.append(CarriedGroup(list(g.inputs), list(g.prompt_ids), g.seed))
        return cls(step, groups, not_saved)

    def to_json(self) -> dict:
        return {"step": self.step, "not_saved": self.not_saved,
                "groups": [{"inputs": g.inputs, "prompt_ids": g.prompt_ids, "seed": g.seed} for g in self.groups]}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict) -> StreamCheckpoint:
        groups = [CarriedGroup(list(g["inputs"]), [int(t) for t in g["prompt_ids"]], int(g["seed"]))
                  for g in data["groups"]]  # fmt: skip
        return cls(int(data["step"]), groups, int(data["not_saved"]))


__all__ = ["CarriedGroup", "GroupStream", "StreamBatch", "StreamCheckpoint", "StreamDry", "StreamGroup"]
