"""`VLLMColocateBackend` without vLLM: a fake `llm.llm_engine` (add_request / step / abort_request).

The real engine is tested in tests/real_vllm/test_colocate.py (`make test-vllm`). Here: outputs become the
right `Segment`s, requests join a running batch, and an engine failure reaches every caller with its cause
(and every later caller at once) instead of a hang.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace as NS

import pytest

from appo_trl.rollout import SamplingParams
from appo_trl.rollout.vllm_colocate import VLLMColocateBackend, VLLMColocateError, parse_output


def output(rid, ids, reason, stop_reason=None, cached=0, top=None):
    lps = [{t: NS(logprob=-0.25 * (i + 1)), **(top or {})} for i, t in enumerate(ids)]
    choice = NS(token_ids=ids, logprobs=lps, finish_reason=reason, stop_reason=stop_reason)
    return NS(request_id=rid, finished=True, outputs=[choice], num_cached_tokens=cached)


class FakeEngine:
    """Answers each request after `delay` steps with `script(prompt)`; `fail_at` makes a step raise."""

    def __init__(self, script, delay=2, fail_at=None):
        self.script, self.delay, self.fail_at = script, delay, fail_at
        self.running: dict[str, list] = {}
        self.steps = 0
        self.batch_sizes: list[int] = []

    def add_request(self, rid, prompt, params):
        if len(prompt["prompt_token_ids"]) > 100:
            raise ValueError("prompt too long")
        self.running[rid] = [prompt["prompt_token_ids"], self.delay]

    def step(self):
        self.steps += 1
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise MemoryError("KV cache exhausted")
        self.batch_sizes.append(len(self.running))
        done = []
        for rid, entry in list(self.running.items()):
            entry[1] -= 1
            if entry[1] <= 0:
                done.append(output(rid, *self.script(entry[0])))
                del self.running[rid]
        return done

    def abort_request(self, rids):
        for rid in rids:
            self.running.pop(rid, None)


def backend_on(engine):
    backend = VLLMColocateBackend(NS(llm_engine=engine))
    backend.sampling_params = lambda params: params  # no vLLM here: the fake takes ours
    return backend


def test_outputs_become_segments():
    seg = parse_output(output("a", [5, 6, 7], "stop", "</python>"), want_top=False)
    assert (seg.token_ids, seg.finish_reason, seg.stop_str) == ([5, 6, 7], "stop", "</python>")
    assert seg.logprobs == [-0.25, -0.5, -0.75] and seg.top_logprobs is None
    assert parse_output(output("a", [5, 2], "stop", None), False).finish_reason == "eos"  # EOS
    assert parse_output(output("a", [5, 2], "stop", 2), False).finish_reason == "eos"  # a stop token id
    seg = parse_output(output("a", [5], "length", top={9: NS(logprob=-3.0)}), want_top=True)
    assert seg.finish_reason == "length" and seg.top_logprobs == [{5: -0.25, 9: -3.0}]
    with pytest.raises(VLLMColocateError, match="finish_reason 'abort' after 1 tokens"):
        parse_output(output("a", [5], "abort"), False)
    broken = output("a", [5, 6], "length")
    broken.outputs[0].logprobs = broken.outputs[0].logprobs[:1]
    with pytest.raises(VLLMColocateError, match="2 token ids but 1 logprob entries"):
        parse_output(broken, False)


def test_concurrent_requests_share_the_running_batch():
    engine = FakeEngine(lambda p: ([p[-1] + 1, 2], "stop", None, 3), delay=3)
    backend = backend_on(engine)

    async def many():
        return await asyncio.gather(*[backend.generate([1, i], SamplingParams(max_tokens=4)) for i in range(8)])

    try:
        segs = asyncio.run(many())
    finally:
        backend.close()
    assert [s.token_ids for s in segs] == [[i + 1, 2] for i in range(8)]
    assert max(engine.batch_sizes) > 1  # requests joined a batch in flight, not one at a time
    assert backend.cached_tokens == 24 and backend.num_requests == 8


def test_a_rejected_request_fails_alone():
    backend = backend_on(FakeEngine(lambda p: ([3], "length")))

    async def both():
        return await asyncio.gather(backend.generate([1] * 200, SamplingParams(max_tokens=1)),
                                    backend.generate([1], SamplingParams(max_tokens=1)),
                                    return_exceptions=True)  # fmt: skip

    try:
        bad, good = asyncio.run(both())
    finally:
        backend.close()
    assert isinstance(bad, VLLMColocateError) and "prompt too long" in str(bad)
    assert good.token_ids == [3]


def test_an_engine_failure_reaches_every_caller_with_its_cause():
    backend = backend_on(FakeEngine(lambda p: ([3], "length"), delay=5, fail_at=2))

    async def many():
        return await asyncio.wait_for(
            asyncio.gather(*[backend.generate([1, i], SamplingParams(max_tokens=1)) for i in range(3)],
                           return_exceptions=True),
            timeout=30,
        )  # fmt: skip

    errors = asyncio.run(many())
    assert all(isinstance(e, VLLMColocateError) for e in errors)
    assert "MemoryError: KV cache exhausted" in str(errors[0]) and isinstance(errors[0].__cause__, MemoryError)
    with pytest.raises(VLLMColocateError, match="failed earlier: KV cache exhausted"):
        asyncio.run(backend.generate([1], SamplingParams(max_tokens=1)))


def test_close_with_requests_in_flight_fails_them():
    engine = FakeEngine(lambda p: ([3], "length"), delay=10**9)
    backend = backend_on(engine)

    async def go():
        job = asyncio.ensure_future(backend.generate([1], SamplingParams(max_tokens=1)))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(backend.close)
        return await asyncio.wait_for(job, timeout=30)

    with pytest.raises(VLLMColocateError, match="closed with requests in flight"):
        asyncio.run(go())
    assert engine.running == {}  # aborted in the engine too
