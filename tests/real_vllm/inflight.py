"""Helpers of the in-flight update tests: the trainer's reference logprobs of a completion sampled across an update
(keep mode: the old weights' KV cache under the new weights), `Background` (a streamed request in a thread) and
`sample_across_an_update` (a long request paused mid-generation; its decode steps held by `slow_steps.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from appo_trl.sampling import SamplingParams, Segment
from appo_trl.vllm.inflight import PolicyClock, ServerPause
from appo_trl.vllm.server import VLLMServerBackend
from tests.rollout.pausable_vllm import Background  # noqa: F401  (the tests import it from here)
from tests.rollout.reference_logps import TOL, kept_cache_logps, logps_from, plain_logps, worst  # noqa: F401

MAX_TOKENS = 1500
STEP_S = 0.005  # each decode step of the measured request takes at least this long: 1,500 tokens take >= 7.5 s


def sample_across_an_update(url: str, prompt: list[int], *, mode: str, version: int, update: Callable[[], None],
                            undo: Callable[[], None], seed: int, model: str | None = None,
                            attempts: int = 3) -> tuple[Segment, int, VLLMServerBackend]:  # fmt: skip
    """(segment, boundary, backend): a `MAX_TOKENS` request sampled at `version - 1`, the server paused in `mode` at
    its 40th streamed token while `update()` loads the weights of `version`, then resumed. Again, after `undo()`,
    when the request finished before the pause came (each step takes `STEP_S` at least, so the pause has seconds)."""
    from slow_steps import KEY  # it imports vllm: here, so that `make test` (no vllm) collects this folder

    for _ in range(attempts):
        clock = PolicyClock(version - 1)
        backend = VLLMServerBackend(url, model=model, clock=clock,
                                    extra_body={"ignore_eos": True, "vllm_xargs": {KEY: STEP_S}})  # fmt: skip
        start = time.monotonic()
        request = Background(backend, prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed))
        request.wait_tokens(clock, 40)
        pause = ServerPause([url], mode=mode, clock=clock)
        with pause.paused(version=version):
            at_pause = clock.tokens_received
            update()
        seg = request.result()
        took = time.monotonic() - start
        assert took >= MAX_TOKENS * STEP_S, f"{took:.1f} s: the server's slow_steps processor did not hold the steps"
        print(f"{mode}: {len(seg.token_ids)} tokens in {took:.1f} s, runs {seg.version_runs}, {at_pause} received when /pause "
              f"answered, paused {pause.pause_s_last:.2f} s, aborts {backend.num_aborts}")  # fmt: skip
        assert seg.finish_reason == "length" and len(seg.token_ids) == MAX_TOKENS
        if len(seg.version_runs) == 2:
            break
        assert seg.version_runs == [(version - 1, MAX_TOKENS)]  # done before the pause: all under the old weights
        undo()
    (v0, boundary), (v1, rest) = seg.version_runs
    assert (v0, v1) == (version - 1, version) and boundary >= at_pause and rest == MAX_TOKENS - boundary
    return seg, boundary, backend
