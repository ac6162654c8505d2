"""Generation overlapping training (`max_staleness: k >= 1`): the next round samples while the current one trains.

`AsyncRounds` hands the round runner (`appo_trl.trainer.rounds`) the round of each generation batch, launches the
next one on a daemon thread with the jobs the runner gives it, keeps the staleness bound and the sync points, and
stops every rank together on a failed round. It does not sample, score or compute losses. Hand-over, bound,
correction, APPO's selection forward and faults: docs/architecture.md, "Async rounds".
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerCallback

from appo_trl import trl_rules
from appo_trl.tools.main_thread import MAIN_THREAD
from appo_trl.trainer.batch_lookahead import BatchLookahead

logger = logging.getLogger(__name__)


class BackgroundRoundError(RuntimeError):
    """A background generation round failed; the original exception is the `__cause__`."""


class RoundAborted(RuntimeError):
    """Raised on a round thread whose selection forward waited for weights that evaluation would hold back."""


def agree_on_round_faults(error: BaseException | None, launched_at: int) -> None:
    """Raise `BackgroundRoundError` on every rank when a background round failed on any rank.

    Called at every hand-over on every rank (the ranks hand over at the same steps), so with several processes
    each rank learns of a peer's failed round at the same hand-over, with the peer's rank and cause, instead of
    waiting at its next collective until the process group times out. One all-gather of a short string (or
    None) per generation round; with one process, or no process group, nothing is exchanged.
    """
    mine = None if error is None else f"{type(error).__name__}: {error}"
    failed = [(0, mine)] if mine is not None else []
    dist = torch.distributed
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if several:
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        failed = [(rank, msg) for rank, msg in enumerate(every) if msg is not None]
    if not failed:
        return
    causes = "; ".join(f"rank {rank}: {msg}" for rank, msg in failed) if several else failed[0][1]
    message = f"the generation round launched in the background at step {launched_at} failed: {causes}"
    if error is not None:
        raise BackgroundRoundError(message) from error
    raise BackgroundRoundError(message + " (this rank's own round was fine; every rank stops together)")


class SamplerCopy:
    """A frozen copy of the policy for the in-process backend, synced from the policy at the sync points."""

    def __init__(self, policy: torch.nn.Module):
        self.model = copy.deepcopy(policy).eval()
        self.model.requires_grad_(False)

    @torch.no_grad()
    def sync(self, policy: torch.nn.Module) -> None:
        self.model.load_state_dict(policy.state_dict())


class OptimizerStepLock(TrainerCallback):
    """Holds `rounds.weights_lock` from `on_pre_optimizer_step` to `on_optimizer_step` (no reader sees
    half-updated weights), then counts the step and wakes the rounds waiting for it."""

    def __init__(self, rounds: AsyncRounds):
        self.rounds, self.held = rounds, False

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.rounds.weights_lock.acquire()
        self.held = True

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.held:
            self.held = False
            self.rounds.weights_lock.release()
        with self.rounds.stepped:
            self.rounds.optimizer_steps += 1
            self.rounds.stepped.notify_all()


@dataclass
class PendingRound:
    inputs: Any  # the generation batch it was launched for (matched by identity)
    future: Future
    version: int  # optimizer step of the weights that sample it
    step: int  # global step at launch
    thread: threading.Thread
    ticket: int  # `optimizer_steps` at its hand-over: its selection forward waits for these weights
    abort: threading.Event  # set: its selection forward raises `RoundAborted` instead of waiting


@dataclass
class HandedRound:
    step: int  # global step at hand-over
    version: int
    staleness: int  # step − version (the first slice's rows)
    background: bool  # True: generated in the background; False: synchronously at hand-over
    rows: int


class AsyncRounds:
    """One round generating in the background while the previous one trains (docs/architecture.md, "Async rounds").

    Args:
        max_staleness: k >= 1.
        weight_sync_steps: sync at least every this many optimizer steps (<= k).
        steps_per_round: optimizer steps one generation batch trains (m).
        micro_steps_per_round: training micro-steps between two generation batches (TRL's generate_every).
        sync_fn: pushes the trainer's current weights to the sampler (called on the trainer's thread).
        max_steps: the run's last step (no round is launched that would train at or after it; <= 0: no limit).
        sampler: the in-process sampler copy `sync_fn` syncs (None with vLLM).
    """

    def __init__(self, max_staleness: int, weight_sync_steps: int, steps_per_round: int, micro_steps_per_round: int,
                 sync_fn: Callable[[], None], max_steps: int = 0, sampler: SamplerCopy | None = None):  # fmt: skip
        self.k, self.w, self.m, self.every = max_staleness, weight_sync_steps, steps_per_round, micro_steps_per_round
        self.sync_fn = sync_fn
        self.sampler = sampler
        self.max_steps = max_steps
        self.version: int | None = None  # the sampler's weights (None: not synced yet, e.g. before a resume)
        self.pending: PendingRound | None = None
        self.lookahead = BatchLookahead()
        self.warned_one_batch_epochs = False
        self.weights_lock = threading.Lock()
        self.stepped = threading.Condition()
        self.optimizer_steps = 0  # counted by OptimizerStepLock
        self._local = threading.local()  # on a round thread: `ticket` (the step its forward waits for), `abort`
        self.history: list[HandedRound] = []
        self.num_syncs = 0
        self.dropped_rows = 0
        self.discarded_rounds = 0
        self.wait_s = 0.0  # trainer time spent waiting for background rounds
        self.sync_generate_s = 0.0  # trainer time spent generating rounds synchronously
        self.closed = False
        self.last_thread: threading.Thread | None = None  # the newest round thread (tests, shutdown checks)
        self._step_metrics: dict[str, float] = {}

    # ---- hand-over ------------------------------------------------------------------------------------------
    def next_round(self, inputs, step: int, current_job: Callable[[], Any], make_job: Callable[[Any], Callable]):
        """The round for generation batch `inputs` at global step `step`, then launch the next one.

        `current_job()` generates this round synchronously (used when no valid background round exists);
        `make_job(next_inputs)` prepares (on this thread) the job that generates the next round.
        """
        pending, self.pending = self.pending, None
        batch, version, dropped, error = None, None, 0, None
        if pending is not None and pending.inputs is inputs:
            t0 = time.perf_counter()
            try:
                batch = pending.future.result()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - the round thread's failure, raised below with its cause
                error = exc
            finally:
                self.wait_s += time.perf_counter() - t0
        agree_on_round_faults(error, pending.step if pending is not None else step)
        if batch is not None:
            version = pending.version
            if step - version + self.m - 1 > self.k:
                dropped = len(batch.rows)
                self.dropped_rows += dropped
                logger.warning(
                    "dropping a round of %d rows sampled at step %d: at step %d its rows would be up to %d steps "
                    "stale (max_staleness=%d); regenerating it on the current weights",
                    dropped, version, step, step - version + self.m - 1, self.k,
                )  # fmt: skip
                batch = None
        elif pending is not None:  # launched for another batch (e.g. the loop re-generated): wait, then forget it
            self._settle(pending)
            self.discarded_rounds += 1
        background = batch is not None
        if batch is None:
            if self.version != step:
                self._sync(step)
            version = step
            t0 = time.perf_counter()
            batch = current_job()
            self.sync_generate_s += time.perf_counter() - t0
        self._launch_next(inputs, step, make_job)
        staleness = step - version
        rows = len(batch.rows)
        self.history.append(HandedRound(step, version, staleness, background, rows))
        self._step_metrics = {
            "rollout/staleness/mean": staleness + (self.m - 1) / 2,
            "rollout/staleness/max": float(staleness + self.m - 1),
            "rollout/stale_rows_dropped": float(dropped),
            "rollout/weight_syncs": float(self.num_syncs),
            "rollout/background_round": float(background),
        }
        return batch

    def metrics(self) -> dict[str, float]:
        """Per-round metrics of the last hand-over (the trainer logs them under these names)."""
        return dict(self._step_metrics)

    def _launch_next(self, inputs, step: int, make_job) -> None:
        next_step = step + self.m
        if self.closed or (self.max_steps > 0 and next_step >= self.max_steps):
            return
        nxt = self.lookahead.peek(inputs, self.every)
        if nxt is None:
            size = self.lookahead.epoch_batches
            if size is not None and size <= self.every and not self.warned_one_batch_epochs:
                self.warned_one_batch_epochs = True
                logger.warning(
                    "max_staleness=%d: an epoch holds one generation batch (%d micro-batches), so no round can be "
                    "sampled in the background: every round runs synchronously (rollout/background_round 0). "
                    "Environment-owned data (no train_dataset) is always so; a dataset of several generation "
                    "batches overlaps.", self.k, size,
                )  # fmt: skip
            return
        if self.version is None or step - self.version >= self.w or next_step - self.version + self.m - 1 > self.k:
            self._sync(step)
        job = make_job(nxt)
        self.pending = self._submit(nxt, job, step)

    def _submit(self, inputs, job, step: int) -> PendingRound:
        future: Future = Future()
        # its hand-over comes after the m optimizer steps of the round now training: the proximal weights
        ticket, abort = self.optimizer_steps + self.m, threading.Event()

        def work():
            self._local.ticket, self._local.abort = ticket, abort
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(job())
            except BaseException as exc:  # noqa: BLE001 - handed to the trainer at the next hand-over
                future.set_exception(exc)

        thread = threading.Thread(target=work, name=f"appo-round-{step}", daemon=True)
        pending = PendingRound(inputs, future, self.version, step, thread, ticket, abort)
        self.last_thread = thread
        thread.start()
        return pending

    def _sync(self, step: int) -> None:
        self.sync_fn()
        self.version = step
        self.num_syncs += 1

    def _settle(self, pending: PendingRound) -> bool:
        """Wait for `pending` before its hand-over; a selection forward still waiting for the hand-over's weights,
        which cannot come while the trainer waits here, is stopped (`RoundAborted`). True when it was stopped."""
        if self.optimizer_steps < pending.ticket:
            pending.abort.set()
            with self.stepped:
                self.stepped.notify_all()
        self._wait_quietly(pending)
        return not pending.future.cancelled() and isinstance(pending.future.exception(), RoundAborted)

    @staticmethod
    def _wait_quietly(pending: PendingRound, timeout: float | None = None) -> None:
        try:  # on the main thread, runs the round's calls of tools that use signals meanwhile
            MAIN_THREAD.wait(pending.future, timeout)
        except BaseException:  # noqa: BLE001 - a discarded round's own failure or a timeout
            if not pending.future.done() and not isinstance(sys.exc_info()[1], Exception):
                raise  # an interrupt of the main thread itself

    @contextlib.contextmanager
    def trainer_forward(self):
        """Around a trainer forward that may run on a round thread (APPO's branch selection): there, first
        wait for the m optimizer steps of the round training at its launch (so the forward reads the weights of
        its hand-over, the proximal policy it will be trained against, whatever the timing), then hold
        `weights_lock`."""
        ticket = getattr(self._local, "ticket", None)
        if ticket is not None:
            with self.stepped:
                while self.optimizer_steps < ticket:
                    if self.closed:
                        raise RuntimeError("training stopped while a background round waited for its weights")
                    if self._local.abort.is_set():
                        raise RoundAborted("evaluation ran before this round's weights existed")
                    self.stepped.wait(timeout=1.0)
        with self.weights_lock:
            yield

    # ---- evaluation, shutdown -----------------------------------------------------------------------------
    def before_foreground_round(self, step: int) -> None:
        """Before the trainer samples on its own thread (evaluation): let the background round finish (it is
        kept for its hand-over), then bring the sampler to the current weights.

        Evaluation between two hand-overs (m > 1) comes before the weights an APPO selection forward waits for:
        that round is told to stop at its forward (`RoundAborted`) and is dropped, to be generated synchronously
        at its hand-over; a round that does not reach such a forward finishes and is kept."""
        pending = self.pending
        if pending is not None and self._settle(pending):
            logger.info("evaluation at step %d dropped the round launched at step %d (its selection forward waited "
                        "for step %d); it is generated at its hand-over", step, pending.step,
                        pending.ticket)  # fmt: skip
            self.pending = None
            self.discarded_rounds += 1
        if self.version != step:
            self._sync(step)

    def reset(self) -> None:
        """At the start of `Trainer.train`: nothing in flight, the sampler's weights unknown (a resume loads
        a checkpoint after the trainer was built), launches allowed."""
        self.close()
        self.closed, self.version, self.lookahead = False, None, BatchLookahead()

    def close(self, timeout: float = 30.0) -> None:
        """Stop launching, drop the round in flight and join its thread (after the engine was closed, which
        cancels its requests). A thread still alive after `timeout` is a daemon and is left behind, logged."""
        self.closed = True
        pending, self.pending = self.pending, None
        if pending is None:
            return
        pending.future.cancel()
        pending.thread.join(timeout)
        if pending.thread.is_alive():
            logger.warning("the background generation round did not stop within %.0f s (daemon thread)", timeout)


def sampler_threads(current: int) -> int:
    """Torch intra-op threads each side gets when trainer and in-process sampler share the CPU: half the process's
    budget, which is `current` (torch's thread count: the user's `torch.set_num_threads` / `OMP_NUM_THREADS`, or
    torch's default) capped at the cores this process may run on. Each side runs its own intra-op pool of that
    size, so the two together use the budget, not twice it."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(current, cores) // 2)


@contextlib.contextmanager
def split_cpu_threads():
    """Within (`APPOTrainer.train` with the in-process sampler copy): torch's thread count set to
    `sampler_threads`, process-wide; the previous count is restored on exit, whatever happened."""
    before = torch.get_num_threads()
    threads = sampler_threads(before)
    torch.set_num_threads(threads)
    logger.info("max_staleness >= 1 in-process: torch threads %d -> %d while training and sampling overlap",
                before, threads)  # fmt: skip
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def policy_is_sharded(trainer) -> bool:
    """True under DeepSpeed or FSDP: no rank holds the full weights an in-process sampler copy needs."""
    dist = str(getattr(trainer.accelerator, "distributed_type", "NO"))
    return "DEEPSPEED" in dist or "FSDP" in dist


def build_async_rounds(trainer) -> AsyncRounds | None:
    """`AsyncRounds` for `trainer.args.max_staleness >= 1` (None otherwise), with its sync route and, for the
    in-process backend, the sampler copy (`AsyncRounds.sampler`)."""
    args = trainer.args
    if args.max_staleness < 1:
        return None
    every = trl_rules.generate_every(args)
    sharded = policy_is_sharded(trainer)
    if sharded and not args.strategy_class.async_under_sharding:
        raise ValueError(
            "rollout_strategy=appo with max_staleness >= 1 is not supported under DeepSpeed or FSDP: APPO's "
            "branch-selection forward runs on the background round's thread, where it would gather shards "
            "concurrently with the trainer's collectives and read weights DeepSpeed updates inside backward "
            "(outside the optimizer-step lock). Use max_staleness: 0, or DDP."
        )
    sampler = None
    if args.use_vllm:
        from appo_trl.trainer.weight_sync import sync_weights

        def sync_fn():
            sync_weights(trainer)  # and the step TRL's `_last_loaded_step` records

    else:
        if sharded:
            raise ValueError(
                "max_staleness >= 1 with the in-process backend keeps a full copy of the policy as the sampler; "
                "under DeepSpeed or FSDP the policy is sharded: use the vLLM server (use_vllm: true)."
            )
        sampler = SamplerCopy(trainer.accelerator.unwrap_model(trainer.model))  # threads: split_cpu_threads

        def sync_fn():
            sampler.sync(trainer.accelerator.unwrap_model(trainer.model))

    rounds = AsyncRounds(
        args.max_staleness,
        args.weight_sync_steps,
        every // args.gradient_accumulation_steps,
        every,
        sync_fn,
        max_steps=args.max_steps,
        sampler=sampler,
    )
    trainer.add_callback(OptimizerStepLock(rounds))
    return rounds


__all__ = ["AsyncRounds", "BackgroundRoundError", "BatchLookahead", "OptimizerStepLock", "RoundAborted", "SamplerCopy",
           "build_async_rounds", "sampler_threads", "split_cpu_threads"]  # fmt: skip
