"""`VLLMColocateBackend` without vLLM: a fake `llm.llm_engine` (add_request / step / abort_request).

The real engine is tested in tests/real_vllm/test_colocate.py (`make test-vllm`). Here: outputs become the
right `Segment`s, requests join a running batch, an engine failure reaches every caller with its cause
(and every later caller at once) instead of a hang, and sleep mode follows TRL's order around a round.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace as NS

import pytest

from appo_trl.rollout import SamplingParams
from appo_trl.vllm.colocate import VLLMColocateBackend, VLLMColocateError, parse_output


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


# ---- sleep mode: TRL's order around one round ----------------------------------------------------------------------


class SleepingLLM:
    """A fake `vllm.LLM` built with `enable_sleep_mode=True` that logs every call in order: wake_up / sleep,
    weight loads and the prefix-cache reset (TRL's `sync_weights`), and the engine's add_request / step."""

    def __init__(self, events):
        self.events = events
        engine = FakeEngine(lambda p: ([7, 2], "stop", None), delay=1)
        add, step = engine.add_request, engine.step
        engine.add_request = lambda *a: (events.append("add_request"), add(*a))[1]
        engine.step = lambda: (events.append("step"), step())[1]
        model = NS(load_weights=lambda weights: events.extend(f"load {name}" for name, _ in weights))
        engine.model_executor = NS(driver_worker=NS(model_runner=NS(model=model)))
        self.llm_engine = engine

    def wake_up(self, tags=None):
        self.events.append(f"wake_up {','.join(tags)}")

    def sleep(self, level=1):
        self.events.append(f"sleep level={level}")

    def reset_prefix_cache(self):
        self.events.append("reset_prefix_cache")


def sleeping_trainer(events):
    """A trainer as `generate_round` sees it, with TRL's own `VLLMGeneration.sync_weights` (colocate, sleep mode) on
    the fake engine, asleep as TRL leaves it after building the LLM (`_llm_weights_sleeping`)."""
    import torch
    from trl.generation.vllm_generation import VLLMGeneration

    llm = SleepingLLM(events)
    gen = object.__new__(VLLMGeneration)
    gen.mode, gen.enable_sleep_mode, gen._llm_weights_sleeping, gen.llm = "colocate", True, True, llm
    gen.accelerator = NS(is_main_process=True)
    gen._iter_named_params = lambda: iter([("w", torch.zeros(1))])
    backend = backend_on(llm.llm_engine)
    backend.llm, backend.sleep_mode = llm, True
    return NS(use_vllm=True, rollout_engine=NS(backend=backend), vllm_generation=gen, state=NS(global_step=0),
              _last_loaded_step=0, accelerator=NS(device="cpu", gather=lambda t: t))  # fmt: skip


def test_sleep_mode_wakes_weights_to_sync_then_the_kv_cache_for_the_round_then_sleeps_level_2():
    """TRL 1.16's colocate generate: weights are dropped by level-2 sleep, so they are woken and re-pushed
    (`sync_weights`: wake_up(weights), load, reset the prefix cache); the KV cache is woken for generation; after
    it, `sleep(level=2)` and `_llm_weights_sleeping = True`. A second round at the same step syncs again (the
    weights slept), and a round that raises still puts the engine to sleep."""
    from appo_trl.trainer.weight_sync import generate_round

    events: list[str] = []
    trainer = sleeping_trainer(events)
    gen, backend = trainer.vllm_generation, trainer.rollout_engine.backend

    def sample():
        events.append(f"sample (weights sleeping: {gen._llm_weights_sleeping})")
        return asyncio.run(backend.generate([1, 2], SamplingParams(max_tokens=2))).token_ids

    round_events = ["wake_up weights", "load w", "reset_prefix_cache", "wake_up kv_cache",
                    "sample (weights sleeping: False)", "add_request", "step", "sleep level=2"]  # fmt: skip
    try:
        assert generate_round(trainer, sample) == [7, 2]
        assert events == round_events and gen._llm_weights_sleeping is True
        events.clear()
        assert generate_round(trainer, sample) == [7, 2]  # same global step: the weights slept, so synced again
        assert events == round_events and gen._llm_weights_sleeping is True

        def broken():
            raise RuntimeError("tool crashed")

        events.clear()
        with pytest.raises(RuntimeError, match="tool crashed"):
            generate_round(trainer, broken)
        assert events[-1] == "sleep level=2" and gen._llm_weights_sleeping is True
    finally:
        backend.close()
