"""`rollout_stream: true` at the trainer: the generation batch TRL scores is the stream's oldest complete groups.

`StreamRounds` feeds `GroupStream` (appo_trl/trainer/streaming.py) TRL's generation batches (the current one and,
through `BatchLookahead`, the ones after it, across an epoch's end too when another epoch runs, so groups sample
while the trainer trains), syncs the weights in flight at every hand-over (`InFlightSync`: every server paused, the
disk or adapter route, resumed; in process, `InProcessSync`: the sampler copy's weights swapped between two decode
steps), swaps TRL's inputs for the
rows of the groups it hands over, and holds their `Round` for the runner's `generate`. Each group samples as one
sampling path's `start_group` (the tool loop: one `RolloutEngine.rollout` of one prompt on the engine's loop;
environments: on instances of its own; an agent: n runs through the endpoint); a token's policy version comes from
the streamed server sampler (`PolicyClock`). An evaluation round syncs in flight first (`sync_to`). It does not
score or compute losses: the correction is TRL's importance weight against the sampler's per-token logprobs
(docs/streaming.md, "The ratio"). Start-up refusals: one line.
"""

from __future__ import annotations

import logging
import math

from appo_trl import trl_rules
from appo_trl.rollout.decode_gate import DecodeGate
from appo_trl.strategies import Round
from appo_trl.trainer import trl_seams
from appo_trl.trainer.async_rounds import SamplerCopy, policy_is_sharded
from appo_trl.trainer.batch_lookahead import BatchLookahead, next_epoch_iterator
from appo_trl.trainer.inflight_sync import InFlightSync, InProcessSync
from appo_trl.trainer.streaming import GroupStream, StreamCheckpoint, StreamGroup
from appo_trl.vllm.inflight import PolicyClock, pause_capability

logger = logging.getLogger(__name__)


class StreamRounds:
    """The streaming producer of one `APPOTrainer` (module docstring).

    Args:
        trainer: the `APPOTrainer` (its args, vLLM server spec and weight sync, tokenizer, state).
        runner: its `RoundRunner` (the rollout engine, the seeds).
    """

    def __init__(self, trainer, runner):
        args = trainer.args
        self.trainer, self.runner, self.n = trainer, runner, trainer.num_generations
        self.clock = PolicyClock(-1)  # the first hand-over syncs (a resume's weights are not the server's)
        self.sampler: SamplerCopy | None = None  # in process: the copy that decodes, and the gate of its steps
        self.gate: DecodeGate | None = None
        if args.use_vllm:
            self.sync = InFlightSync(trainer.vllm_generation, list(trainer.vllm_server.urls), args.inflight_update,
                                     self.clock, timeout_s=args.inflight_timeout_s)  # fmt: skip
        else:
            policy = lambda: trainer.accelerator.unwrap_model(trainer.model)  # noqa: E731
            self.sampler, self.gate = SamplerCopy(policy()), DecodeGate(self.clock, args.inflight_update)
            self.sync = InProcessSync(self.sampler, policy, self.gate, self.clock)
        self.every = trl_rules.generate_every(args)
        self.m = max(1, self.every // args.gradient_accumulation_steps)
        self.k, self.overprovision = args.max_staleness, args.stream_overprovision
        self.lookahead = BatchLookahead(self._next_epoch)
        self.stream: GroupStream | None = None
        self._fed: dict[int, object] = {}  # id -> batch, the generation batches fed (their references keep ids)
        self.pending: tuple[Round, object] | None = None  # the Round of the inputs handed to TRL, and those inputs
        self.restored: StreamCheckpoint | None = None  # a resume's carried-over groups, fed first
        self.metrics: dict[str, float] = {}

    # ---- start, stop --------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """At the start of `Trainer.train`: nothing in flight, the server's weights unknown."""
        self.close()
        self.stream, self._fed, self.pending, self.lookahead = None, {}, None, BatchLookahead(self._next_epoch)
        self.clock.held = False

    def close(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            dropped = stream.close()
            if dropped:
                logger.info("rollout_stream: %d group(s) unfinished at the end of training were dropped", dropped)

    def checkpoint(self, step: int) -> StreamCheckpoint:
        """At a checkpoint at `step`: the groups carried over from earlier batches, which it keeps (a resume samples
        them again); the groups of later batches are not kept (the resumed data loader feeds their batches again)."""
        ckpt = StreamCheckpoint.of(self.stream, step)
        later = len(self.stream.unfinished()) - len(ckpt.groups) - ckpt.not_saved if self.stream is not None else 0
        if ckpt.groups or later:
            logger.info("checkpoint at step %d: %d group(s) carried over from earlier batches are saved, to be sampled "
                        "again at a resume; %d group(s) of the batches from step %d on are not (a resume feeds those "
                        "batches again)", step, len(ckpt.groups), later, step)  # fmt: skip
        if ckpt.not_saved:
            logger.warning("checkpoint at step %d: %d carried-over group(s) have dataset rows that are not JSON and are "
                           "not saved: a resume from it does not sample them", step, ckpt.not_saved)  # fmt: skip
        return ckpt

    def restore(self, ckpt: StreamCheckpoint) -> None:
        """A resume: `ckpt`'s groups are fed before the first batch (they are older)."""
        self.restored = ckpt

    def _feed_restored(self, step: int) -> None:
        ckpt, self.restored = self.restored, None
        if ckpt is None:
            if step > 0:
                logger.warning("[resume] starting at step %d with no stream state in the checkpoint (a run without "
                               "rollout_stream, or an older version): groups carried over before it are not sampled "
                               "again", step)  # fmt: skip
            return
        if ckpt.step != step:
            raise RuntimeError(f"rollout_stream: the checkpoint's stream state is of step {ckpt.step}, the resume "
                               f"starts at step {step}")  # fmt: skip
        for g in ckpt.groups:
            self.stream.feed(g.inputs, [g.prompt_ids], [g.seed], step=step - 1)
        logger.info("[resume] %d group(s) were in flight at checkpoint-%d; they are sampled again%s", len(ckpt.groups),
                    step, f" ({ckpt.not_saved} not saved: rows not JSON)" if ckpt.not_saved else "")  # fmt: skip

    def _next_epoch(self):
        return next_epoch_iterator(self.trainer)  # a peek past this epoch's end (the stream looks ahead across it)

    def _start_group(self, group: StreamGroup):
        return self.runner.path.start_group(group, self.n)  # the path's own sampler (the trainer's thread)

    def _build(self, num_groups: int) -> GroupStream:
        max_groups = max(num_groups, math.ceil(num_groups * (1.0 + self.overprovision)))
        return GroupStream(self._start_group, lambda: self.clock.version, group_size=self.n, max_groups=max_groups,
                           max_staleness=self.k, steps_per_round=self.m)  # fmt: skip

    def _feed(self, batch, step: int) -> None:
        if batch is None or id(batch) in self._fed:
            return
        self._fed[id(batch)] = batch
        firsts = [batch[g * self.n] for g in range(len(batch) // self.n)]
        prompt_ids = self.runner.path.stream_prompt_ids([x.get("prompt") for x in firsts])
        self.stream.feed(list(batch), prompt_ids, [self.runner.next_seed() for _ in firsts], step=step)

    # ---- hand-over ----------------------------------------------------------------------------------------------
    def sync_to(self, step: int) -> None:
        """The servers to the weights of optimizer step `step`, in flight (the groups sampling are paused, not
        drained), unless they hold them: before a hand-over, and before an evaluation round, whose own weight sync
        would reload the weights under the groups in flight without their versions knowing it."""
        if self.clock.version != step:
            self.sync.sync(step)
            trl_seams.mark_weights_synced(self.trainer)

    def inputs_for(self, inputs: list[dict]) -> list[dict]:
        """TRL's generation batch `inputs` -> the rows of the oldest complete groups within the bound (the same
        number), after the weights were synced in flight; their `Round` waits for `take_round`."""
        t = self.trainer
        step = t.state.global_step
        if len(inputs) % self.n:
            raise RuntimeError(f"rollout_stream: a generation batch of {len(inputs)} rows is not whole groups of "
                               f"{self.n}")  # fmt: skip
        num_groups = len(inputs) // self.n
        self.sync_to(step)  # first: a group fed before it would sample the server's old weights with no version
        if self.stream is None:
            self.stream = self._build(num_groups)
            self._feed_restored(step)
        self._feed(inputs, step)
        ahead = max(1, math.ceil(self.overprovision)) + 1  # the batches after it keep the buffer full
        for j in range(1, ahead + 1):
            self._feed(self.lookahead.peek(inputs, self.every * j), step + self.m * j)
        while len(self._fed) > 64:
            self._fed.pop(next(iter(self._fed)))
        batch = self.stream.take(num_groups, step)
        groups = [g.rows() for g in batch.groups]
        for index, rows in enumerate(groups):
            for row in rows:
                row.group = index
        rnd = Round(groups=groups, keep=[True] * sum(len(g) for g in groups))
        # an agent's counts, the environments' own instances, a branching strategy's tree metrics
        self.runner.path.stream_round(rnd, batch.groups)
        self.pending = (rnd, batch.inputs)
        self.metrics = {**batch.metrics, "rollout/stream/pause_s": self.sync.pause_s[-1] if self.sync.pause_s else 0.0,
                        "rollout/weight_syncs": float(len(self.sync.pause_s))}  # fmt: skip
        return batch.inputs

    def take_round(self, inputs: list[dict] | None) -> tuple[Round, int]:
        """The Round of the inputs `inputs_for` handed to TRL (`inputs`: the rows TRL is scoring), and the oldest
        policy version of its tokens."""
        if self.pending is None:
            raise RuntimeError("rollout_stream: TRL asked for a round that the stream did not hand over")
        rnd, handed = self.pending
        self.pending = None
        if inputs is None or list(inputs) != list(handed):
            raise RuntimeError("rollout_stream: TRL's rows are not those of the groups handed over")
        versions = [v for r in rnd.rows if (v := r.oldest_version()) is not None]
        return rnd, min(versions) if versions else self.clock.version


def build_stream_rounds(trainer, runner) -> StreamRounds | None:
    """`StreamRounds` under `rollout_stream: true` (None otherwise); what it cannot honour is one line, and a
    server without `/pause` one warning (then None: the max_staleness rounds of today)."""
    args = trainer.args
    if not args.rollout_stream:
        return None
    if trainer.accelerator.num_processes > 1:
        raise ValueError("rollout_stream: true runs in one process so far (each rank would stream its own groups "
                         "and hand over at different times); run one process, or rollout_stream: false.")  # fmt: skip
    if not runner.path.streams:
        raise ValueError(f"rollout_stream: true streams the tool loop's, environments' and agents' groups; the "
                         f"{runner.path.name} path does not stream yet (rollout_stream: false).")  # fmt: skip
    if runner.strategy.branches and runner.path.name != "tool_loop":
        raise ValueError(f"rollout_stream: true with rollout_strategy={args.rollout_strategy} streams the tool loop's "
                         f"trees; the {runner.path.name} path streams grpo groups only (rollout_strategy: grpo, or "
                         "rollout_stream: false).")  # fmt: skip
    if not args.use_vllm and policy_is_sharded(trainer):
        raise ValueError("rollout_stream: true in process keeps a full copy of the policy as the sampler; under "
                         "DeepSpeed or FSDP the policy is sharded: use the vLLM server (use_vllm: true).")  # fmt: skip
    if args.use_vllm and not pause_capability(list(trainer.vllm_server.urls)):
        return None  # the one line was logged: the weights sync between rounds (max_staleness)
    return StreamRounds(trainer, runner)


__all__ = ["StreamCheckpoint", "StreamRounds", "build_stream_rounds"]
