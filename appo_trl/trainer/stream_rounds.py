"""`rollout_stream: true` at the trainer: the generation batch TRL scores is the stream's oldest complete groups.

`StreamRounds` feeds `GroupStream` (appo_trl/trainer/streaming.py) TRL's generation batches (the current one and,
through `BatchLookahead`, the ones after it, so groups sample while the trainer trains), syncs the weights in flight
at every hand-over (`InFlightSync`: every server paused, the disk route, resumed), swaps TRL's inputs for the
rows of the groups it hands over, and holds their `Round` for the runner's `generate`. Each group samples as one
`RolloutEngine.rollout` of one prompt on the engine's loop thread; a token's policy version comes from the
streamed server sampler (`PolicyClock`). It does not score or compute losses: the correction is TRL's importance
weight against the sampler's per-token logprobs (docs/streaming.md, "The ratio"). Start-up refusals: one line.
"""

from __future__ import annotations

import logging
import math

from appo_trl import trl_rules
from appo_trl.strategies import Round
from appo_trl.trainer import trl_seams
from appo_trl.trainer.async_rounds import BatchLookahead
from appo_trl.trainer.inflight_sync import InFlightSync
from appo_trl.trainer.streaming import GroupStream
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
        self.sync = InFlightSync(trainer.vllm_generation, list(trainer.vllm_server.urls), args.inflight_update,
                                 self.clock, timeout_s=args.inflight_timeout_s)  # fmt: skip
        self.every = trl_rules.generate_every(args)
        self.m = max(1, self.every // args.gradient_accumulation_steps)
        self.k, self.overprovision = args.max_staleness, args.stream_overprovision
        self.lookahead = BatchLookahead()
        self.stream: GroupStream | None = None
        self._fed: dict[int, object] = {}  # id -> batch, the generation batches fed (their references keep ids)
        self.pending: tuple[Round, object] | None = None  # the Round of the inputs handed to TRL, and those inputs
        self.metrics: dict[str, float] = {}

    # ---- start, stop --------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """At the start of `Trainer.train`: nothing in flight, the server's weights unknown."""
        self.close()
        self.stream, self._fed, self.pending, self.lookahead = None, {}, None, BatchLookahead()
        self.clock.held = False

    def close(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            dropped = stream.close()
            if dropped:
                logger.info("rollout_stream: %d group(s) unfinished at the end of training were dropped", dropped)

    def note_checkpoint(self, step: int) -> None:
        """At a checkpoint: say what it does not hold (the groups in flight, complete or queued)."""
        unfinished = self.stream.unfinished() if self.stream is not None else []
        if unfinished:
            logger.info("checkpoint at step %d: %d group(s) of the stream (sampling, complete or queued) are not "
                        "saved; a resume samples the data from step %d on again, and a group carried over from an "
                        "earlier batch is not sampled again", step, len(unfinished), step)  # fmt: skip

    def _start_group(self, prompt_ids: list[int], seed: int):
        engine = self.runner.engine

        async def one_group():
            return (await engine.rollout([prompt_ids], self.n, seed=seed))[0]

        return engine.submit(one_group())

    def _build(self, num_groups: int) -> GroupStream:
        max_groups = max(num_groups, math.ceil(num_groups * (1.0 + self.overprovision)))
        return GroupStream(self._start_group, lambda: self.clock.version, group_size=self.n, max_groups=max_groups,
                           max_staleness=self.k, steps_per_round=self.m)  # fmt: skip

    def _feed(self, batch) -> None:
        if batch is None or id(batch) in self._fed:
            return
        self._fed[id(batch)] = batch
        firsts = [batch[g * self.n] for g in range(len(batch) // self.n)]
        prompt_ids = trl_seams.tokenize_prompts(self.trainer, [x["prompt"] for x in firsts])
        self.stream.feed(list(batch), [list(p) for p in prompt_ids], [self.runner.next_seed() for _ in firsts])

    # ---- hand-over ----------------------------------------------------------------------------------------------
    def inputs_for(self, inputs: list[dict]) -> list[dict]:
        """TRL's generation batch `inputs` -> the rows of the oldest complete groups within the bound (the same
        number), after the weights were synced in flight; their `Round` waits for `take_round`."""
        t = self.trainer
        step = t.state.global_step
        if len(inputs) % self.n:
            raise RuntimeError(f"rollout_stream: a generation batch of {len(inputs)} rows is not whole groups of "
                               f"{self.n}")  # fmt: skip
        num_groups = len(inputs) // self.n
        if self.stream is None:
            self.stream = self._build(num_groups)
            if step > 0:
                logger.warning("rollout_stream: starting at step %d (a resume) with no group in flight: the groups "
                               "the checkpoint did not hold are sampled again from the data of step %d on",
                               step, step)  # fmt: skip
        if self.clock.version != step:
            self.sync.sync(step)
            trl_seams.mark_weights_synced(t)
        self._feed(inputs)
        ahead = max(1, math.ceil(self.overprovision)) + 1  # the batches after it keep the buffer full
        for j in range(1, ahead + 1):
            self._feed(self.lookahead.peek(inputs, self.every * j))
        while len(self._fed) > 64:
            self._fed.pop(next(iter(self._fed)))
        batch = self.stream.take(num_groups, step)
        groups = [g.rows() for g in batch.groups]
        for index, rows in enumerate(groups):
            for row in rows:
                row.group = index
        rnd = Round(groups=groups, keep=[True] * sum(len(g) for g in groups))
        self.pending = (rnd, batch.inputs)
        self.metrics = {**batch.metrics, "rollout/stream/pause_s": self.sync.pause_s[-1] if self.sync.pause_s else 0.0,
                        "rollout/weight_syncs": float(len(self.sync.pause_s))}  # fmt: skip
        return batch.inputs

    def take_round(self, prompts: list) -> tuple[Round, int]:
        """The Round of the inputs `inputs_for` handed to TRL, and the oldest policy version of its tokens."""
        if self.pending is None:
            raise RuntimeError("rollout_stream: TRL asked for a round that the stream did not hand over")
        rnd, inputs = self.pending
        self.pending = None
        if [x["prompt"] for x in inputs] != list(prompts):
            raise RuntimeError("rollout_stream: TRL's prompts are not those of the groups handed over")
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
    if runner.path.name != "tool_loop":
        raise ValueError(f"rollout_stream: true streams the tool loop's groups; the {runner.path.name} path does "
                         "not stream yet (rollout_stream: false).")  # fmt: skip
    if not pause_capability(list(trainer.vllm_server.urls)):
        return None  # the one line was logged: the weights sync between rounds (max_staleness)
    return StreamRounds(trainer, runner)


__all__ = ["StreamRounds", "build_stream_rounds"]
