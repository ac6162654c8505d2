"""`APPOConfig`'s streaming fields (`StreamFields`, a base of `APPOConfig`) and the checks only the config can make.

The producer is `appo_trl.trainer.streaming`, the in-flight sync `appo_trl.trainer.inflight_sync`; the rules are
docs/streaming.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from appo_trl.config.script import _rollout


@dataclass
class StreamFields:
    rollout_stream: bool = field(
        default=False,
        metadata=_rollout(
            "Streaming rollouts (needs max_staleness >= 1, the vLLM server with /pause or the in-process sampler "
            "copy, rollout_strategy grpo, arpo or aepo, one process): groups (trees) sample continuously; a generation batch is the oldest complete groups within the "
            "bound, the staleness per token (the group's oldest); the weights update in flight at every generation "
            "batch (inflight_update). A server without /pause: one line at start-up and today's max_staleness "
            "rounds. See appo_trl.trainer.streaming and docs/streaming.md.",
        ),
    )
    inflight_update: Literal["keep", "abort"] = field(
        default="keep",
        metadata=_rollout(
            "rollout_stream: what a request in flight does at a weight update. `keep` (default): frozen with its KV "
            "cache, it continues under the new weights (nothing recomputed; its sampler logprobs are what it was "
            "drawn from); `abort`: ended and re-fed with its partial tokens, recomputed under the new weights.",
        ),
    )
    stream_overprovision: float = field(
        default=0.0,
        metadata=_rollout(
            "rollout_stream: groups held at once (sampling or complete) beyond one generation batch's, as a "
            "fraction of it (0.5: 1.5x the groups a batch needs); the groups that did not finish carry over. The "
            "buffer's bound (`rollout/stream/buffer_bytes`).",
        ),
    )
    inflight_timeout_s: float = field(
        default=60.0,
        metadata=_rollout(
            "rollout_stream: most seconds one server's /pause may take at an in-flight update (and as long again "
            "a server is watched after one that timed out, for a pause it takes late); a pause over it ends the "
            "run in one line, every server resumed.",
        ),
    )


def check_stream(cfg, fail) -> None:
    """`rollout_stream` and its fields: what the streaming producer can honour."""
    if cfg.stream_overprovision < 0:
        fail(f"stream_overprovision={cfg.stream_overprovision} must be >= 0.")
    if not cfg.inflight_timeout_s > 0:
        fail(f"inflight_timeout_s={cfg.inflight_timeout_s} must be > 0 (seconds one /pause may take).")
    if not cfg.rollout_stream:
        if cfg.inflight_update != "keep" or cfg.stream_overprovision:
            fail("inflight_update / stream_overprovision are settings of rollout_stream: true.")
        return
    if cfg.max_staleness < 1:
        fail("rollout_stream: true needs max_staleness >= 1 (the bound a streamed group is admitted within).")
    if cfg.use_vllm and cfg.vllm_mode != "server":
        fail(f"rollout_stream: true with vllm_mode={cfg.vllm_mode}: the weights update in flight on the vLLM server "
             "(vllm_mode: server, /pause) or on the in-process sampler copy (use_vllm: false).")  # fmt: skip
    if not cfg.strategy_class.streams:
        fail(f"rollout_stream: true with rollout_strategy={cfg.rollout_strategy}: its branch selection is a forward "
             "of the policy on each round's initial rows, which streaming does not run; grpo, arpo and aepo "
             "stream.")  # fmt: skip
    if cfg.vllm_weight_sync == "nccl":
        fail("rollout_stream: true with vllm_weight_sync=nccl: an in-flight update needs the disk route.")


__all__ = ["StreamFields", "check_stream"]
