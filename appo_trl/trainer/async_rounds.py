"""Generation overlapping training (`max_staleness: k >= 1`): the next round samples while the current one trains.

With `max_staleness: 0` (the default) nothing here runs and `APPOTrainer` is synchronous, as before. With k >= 1,
`APPOTrainer._generate` asks `AsyncRounds.next_round` for the round of the generation batch TRL hands it:

1. **Hand-over.** If a background round was launched for exactly this generation batch (same object, see
   `BatchLookahead`), wait for it; its exception, if any, is raised here with its cause (`BackgroundRoundError`),
   so a fault reaches the trainer within one step. Otherwise (first step, after a resume, at an epoch boundary,
   or if the round was launched for another batch) the round is generated synchronously on fresh weights.
2. **Staleness bound.** A round sampled on weights of version s (the optimizer step at the sampler's last sync)
   and handed over at step v trains its m slices (m = optimizer steps per round) at steps v .. v + m − 1, so its
   rows are v − s .. v − s + m − 1 steps stale. If v − s + m − 1 > k the whole round is dropped (all its rows
   share s; `rollout/stale_rows_dropped` counts them) and regenerated synchronously. `rollout/staleness/mean`
   and `/max` log the rows' staleness.
3. **Sync, then launch.** The next generation batch is peeked from the epoch's data iterator; the sampler is
   synced first when `weight_sync_steps` have passed or the bound needs it, then the round is launched on a
   daemon thread. The sync runs on the trainer's thread at hand-over, when no round is in flight: this is the
   drain that keeps a weight sync from landing while a request of an older round decodes, on the vLLM server
   (disk or NCCL route alike, and on every rank, as TRL's collectives need) and on the in-process sampler.

Off-policy correction: decoupled PPO (AReaL, Fu et al. 2025), not a ratio against the behaviour policy alone. The
proximal policy is the trainer's weights at hand-over (TRL's `old_per_token_logps` forward, run at hand-over on the
current weights); the PPO ratio and its clip are taken against it, and the behaviour policy (the sampler's logprobs)
enters only through TRL's importance weight exp(old − sampler), masked or truncated per token or per sequence as
`vllm_importance_sampling_mode` says (default `sequence_mask`; `_clip_max`/`_clip_min`; TRL's own code). Why: the
trust region stays centred on the hand-over weights (at most m − 1 steps old) whatever the staleness (a ratio
against a k-step-old sampler would clip away most of the update as k grows); the correction reuses TRL's vLLM
importance-sampling options unchanged; and APPO's future_kl loss keeps its meaning (drift within the update, not
sampler lag). The in-process backend gets the same correction: TRL gates it on `use_vllm`, so `behaviour_correction`
raises that flag while TRL scores a round and computes a loss (the sampler copy is a separate sampler, exactly like
a server).

Backends: the vLLM server is synced with TRL's or the disk route (`trainer.vllm_generation.sync_weights`); vLLM
colocate mode is refused by `APPOConfig` (its in-process engine would be synced, or put to sleep, while a background
round generates on it); the in-process backend decodes with `SamplerCopy`, a frozen copy of the policy synced at the
same points (not under DeepSpeed ZeRO-3 / FSDP, where the policy is sharded: an error at start-up). For the span of
`train()` torch's intra-op thread count is set to half of min(its current count, usable cores)
(`split_cpu_threads`), so that trainer and sampler share the user's budget instead of oversubscribing it, and
restored when `train()` ends.

APPO: branch selection runs a no-grad trainer forward inside the background round (`score_trajectories`), so APPO
with k >= 1 is refused under DeepSpeed and FSDP at start-up (`build_async_rounds`): there that forward would gather
parameter shards concurrently with the trainer thread's collectives, and DeepSpeed updates the weights inside
`accelerator.backward` (`engine.step()`), where `OptimizerStepLock` does not reach. With `async_fv_policy: proximal`
(default) a round launched at hand-over step v waits for the m optimizer steps of the round training meanwhile
(`optimizer_steps` reaching its ticket, launch + m) and holds `weights_lock` (which the trainer holds around every
optimizer step, `OptimizerStepLock`), so it reads, deterministically, the weights v + m of its own hand-over, the
proximal policy its loss takes the ratio against, and never half-updated ones (the trainer changes no weight between
its m-th step and the hand-over, where it waits for the round). FutureValue exp(Σγ(ℓ_trainer − ℓ_sampler)) then
measures the sampler–trainer mismatch plus the v + m − s steps of policy lag the loss will correct (m with
weight_sync_steps 1; synchronously it measures the mismatch only, since both are version s). `async_fv_policy:
sampler` (in-process backend only) scores with the sampler copy itself (version s): the synchronous reading, no
waiting, but the lag the loss sees is then invisible to the branch score. A round's initial rollouts are sampled
before the wait, so only its branches start after the trainer's m-th step. An evaluation between two hand-overs
(m > 1) comes before those weights exist: the waiting round is dropped (`RoundAborted`, counted in
`discarded_rounds`) and generated synchronously at its hand-over.

Faults and resume: Ctrl-C (or any exception) in `Trainer.train` closes the rollout engine, which cancels the
background round's requests, and joins the round thread (`close`); the thread is a daemon, so a stuck backend
never blocks interpreter exit. Rounds in flight live only in memory: a resumed run starts with a synchronous
round, so a round is never trained twice or half (TRL regenerates a partly trained generation batch itself).

What this module does not do: run more than one round ahead (one round generates while one trains), sample (the
strategies and the rollout engine do), compute losses, survive a vLLM server restart inside a background round
(there the restart surfaces as a `BackgroundRoundError` at its hand-over, and the run stops). The rounds the trainer
generates on its own thread (the first after `train()` starts or resumes, one regenerated after a drop or a discard,
evaluation) go through `weight_sync.generate_round` as synchronous runs do: after the sync here its own sync is
skipped (`_last_loaded_step` is current), and a round during which the server restarted is synced again and re-run
with the same seed (those re-syncs are not counted in `num_syncs` here). With several processes the ranks agree on a
fault at every hand-over (`agree_on_round_faults`, one small all-gather per round): a round that failed on any rank
stops every rank there, each naming the failed rank and its cause, so no rank waits at a later collective for a peer
that died.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerCallback

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


class BatchLookahead:
    """The training loop's batches, with a peek at the generation batch that comes `ahead` batches later.

    `pull` replaces `Trainer.get_batch_samples` (same batches, same order); `peek(batch, ahead)` returns the
    batch the loop will hand to `training_step` `ahead` micro-steps after `batch`, pulling it early from the
    same epoch iterator (None past the epoch's end). Batches are matched by identity, never by content.
    """

    def __init__(self):
        self._it = None
        self._buf: deque = deque()
        self._index: dict[int, tuple[int, Any]] = {}
        self._pos = 0  # stream index of the next batch handed out
        self._done = False

    def _next(self):
        if self._done:
            return None
        try:
            return next(self._it)
        except StopIteration:
            self._done = True
            return None

    def pull(self, iterator, num: int) -> list:
        if iterator is not self._it:  # a new epoch: nothing peeked from the old one survives
            self._it, self._buf, self._index, self._pos, self._done = iterator, deque(), {}, 0, False
        out = []
        for _ in range(num):
            batch = self._buf.popleft() if self._buf else self._next()
            if batch is None:
                break
            self._index[id(batch)] = (self._pos, batch)
            self._pos += 1
            out.append(batch)
        while len(self._index) > 256:  # the references keep ids unique; only recent batches are looked up
            self._index.pop(next(iter(self._index)))
        return out

    def peek(self, batch, ahead: int):
        entry = self._index.get(id(batch))
        if entry is None or entry[1] is not batch:
            return None
        j = entry[0] + ahead - self._pos
        if j < 0:
            return None
        while len(self._buf) <= j:
            nxt = self._next()
            if nxt is None:
                return None
            self._buf.append(nxt)
        return self._buf[j]


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
    """One round generating in the background while the previous one trains (see the module docstring).

    Args:
        max_staleness: k >= 1.
        weight_sync_steps: sync at least every this many optimizer steps (<= k).
        steps_per_round: optimizer steps one generation batch trains (m).
        micro_steps_per_round: training micro-steps between two generation batches (TRL's generate_every).
        sync_fn: pushes the trainer's current weights to the sampler (called on the trainer's thread).
        max_steps: the run's last step (no round is launched that would train at or after it; <= 0: no limit).
    """

    def __init__(self, max_staleness: int, weight_sync_steps: int, steps_per_round: int, micro_steps_per_round: int,
                 sync_fn: Callable[[], None], max_steps: int = 0):  # fmt: skip
        self.k, self.w, self.m, self.every = max_staleness, weight_sync_steps, steps_per_round, micro_steps_per_round
        self.sync_fn = sync_fn
        self.max_steps = max_steps
        self.version: int | None = None  # the sampler's weights (None: not synced yet, e.g. before a resume)
        self.pending: PendingRound | None = None
        self.lookahead = BatchLookahead()
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
        try:
            pending.future.exception(timeout=timeout)
        except Exception:  # noqa: BLE001 - a discarded round's own failure or a timeout
            pass

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


def build_async_rounds(trainer) -> AsyncRounds | None:
    """`AsyncRounds` for `trainer.args.max_staleness >= 1` (None otherwise), with its sync route and, for the
    in-process backend, the sampler copy (`trainer._sampler`)."""
    args = trainer.args
    if args.max_staleness < 1:
        return None
    every = args.steps_per_generation * args.num_iterations
    dist = str(getattr(trainer.accelerator, "distributed_type", "NO"))
    sharded = "DEEPSPEED" in dist or "FSDP" in dist
    if sharded and args.rollout_strategy == "appo":
        raise ValueError(
            "rollout_strategy=appo with max_staleness >= 1 is not supported under DeepSpeed or FSDP: APPO's "
            "branch-selection forward runs on the background round's thread, where it would gather shards "
            "concurrently with the trainer's collectives and read weights DeepSpeed updates inside backward "
            "(outside the optimizer-step lock). Use max_staleness: 0, or DDP."
        )
    if args.use_vllm:

        def sync_fn():
            trainer.vllm_generation.sync_weights()
            trainer._last_loaded_step = trainer.state.global_step

    else:
        if sharded:
            raise ValueError(
                "max_staleness >= 1 with the in-process backend keeps a full copy of the policy as the sampler; "
                "under DeepSpeed or FSDP the policy is sharded: use the vLLM server (use_vllm: true)."
            )
        trainer._sampler = SamplerCopy(trainer.accelerator.unwrap_model(trainer.model))  # threads: split_cpu_threads

        def sync_fn():
            trainer._sampler.sync(trainer.accelerator.unwrap_model(trainer.model))

    rounds = AsyncRounds(
        args.max_staleness,
        args.weight_sync_steps,
        every // args.gradient_accumulation_steps,
        every,
        sync_fn,
        max_steps=args.max_steps,
    )
    trainer.add_callback(OptimizerStepLock(rounds))
    return rounds


def round_job_factory(trainer):
    """`make_job(inputs)` for `AsyncRounds.next_round`: on the trainer's thread, tokenise the prompts of generation
    batch `inputs` and fix the round's seed; the returned job samples the round (on the round's thread)."""
    n, strategy = trainer.num_generations, trainer.strategy

    def make_job(inputs):
        prompt_ids, _, _ = trainer._tokenize_prompts(copy.deepcopy([x["prompt"] for x in inputs]))
        unique, seed = prompt_ids[::n], trainer._round_seed()
        return lambda: strategy.generate(unique, n, seed)

    return make_job


@contextlib.contextmanager
def behaviour_correction(trainer):
    """Within: TRL's behaviour-policy correction applies to the in-process sampler copy too.

    TRL computes the proximal `old_per_token_logps`, the importance weight (any of its four modes) and its metrics, and
    multiplies the loss by it, under `if self.use_vllm and self.vllm_importance_sampling_correction`. With
    `max_staleness >= 1` in-process the rows come from `SamplerCopy`, a separate sampler like a server, so the
    flag is raised for the span of TRL's scoring and loss (no other TRL code reads it there: `_generate` is
    `APPOTrainer`'s). Without background rounds, or with vLLM, this does nothing.
    """
    if getattr(trainer, "_async", None) is None or trainer.args.use_vllm:
        yield
        return
    trainer.use_vllm = True
    try:
        yield
    finally:
        trainer.use_vllm = False


__all__ = ["AsyncRounds", "BackgroundRoundError", "BatchLookahead", "OptimizerStepLock", "RoundAborted", "SamplerCopy",
           "behaviour_correction", "build_async_rounds", "round_job_factory", "sampler_threads",
           "split_cpu_threads"]  # fmt: skip
