"""`TransformersBackend` on the tiny model: logprobs of the sampled ids, batching, seeds, stops, processing."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from appo_trl.rollout import RolloutConfig, RolloutEngine, SamplingParams, TransformersBackend
from appo_trl.rollout.transformers_backend import _process_logits


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


def _run(backend, requests):
    async def go():
        return await asyncio.gather(*(backend.generate(p, s) for p, s in requests))

    return asyncio.run(go())


def test_logprobs_are_the_sampled_tokens_under_the_model(model, tiny_tokenizer, enc):
    prompt = enc("What is 3 plus 4?")
    backend = TransformersBackend(model, tiny_tokenizer)
    [seg] = _run(backend, [(prompt, SamplingParams(max_tokens=10, seed=5, logprobs=4))])
    assert len(seg.token_ids) == len(seg.logprobs) == len(seg.top_logprobs) >= 1
    with torch.no_grad():
        logits = model(torch.tensor([prompt + seg.token_ids])).logits[0]
    ref = torch.log_softmax(logits.float(), -1)
    for i, tok in enumerate(seg.token_ids):
        row = ref[len(prompt) - 1 + i]
        assert seg.logprobs[i] == pytest.approx(float(row[tok]), abs=1e-4)
        assert seg.top_logprobs[i][tok] == seg.logprobs[i]
        top4 = torch.topk(row, 4).indices.tolist()
        assert set(top4) <= set(seg.top_logprobs[i])


def test_batched_equals_single_and_seeds_reproduce(model, tiny_tokenizer, enc):
    prompts = [enc("short"), enc("a much longer prompt with several words in it")]
    params = [SamplingParams(max_tokens=8, seed=s) for s in (1, 2)]
    batched = _run(TransformersBackend(model, tiny_tokenizer, max_batch_size=8), list(zip(prompts, params)))
    single = [
        _run(TransformersBackend(model, tiny_tokenizer, max_batch_size=1), [(p, s)])[0]
        for p, s in zip(prompts, params)
    ]
    for b, s in zip(batched, single):  # left padding and position ids are right
        assert b.token_ids == s.token_ids
        assert b.logprobs == pytest.approx(s.logprobs, abs=1e-4)
    other = _run(TransformersBackend(model, tiny_tokenizer), [(prompts[0], SamplingParams(max_tokens=8, seed=99))])[0]
    assert other.token_ids != batched[0].token_ids


def test_stop_strings_and_max_tokens(model, tiny_tokenizer, enc):
    prompt = enc("The quick brown fox")
    free = _run(TransformersBackend(model, tiny_tokenizer), [(prompt, SamplingParams(max_tokens=12, seed=3))])[0]
    assert free.finish_reason in ("length", "eos")
    k = next(i for i, t in enumerate(free.token_ids) if tiny_tokenizer.decode([t]).strip())
    stop = tiny_tokenizer.decode([free.token_ids[k]]).strip()
    stopped = _run(
        TransformersBackend(model, tiny_tokenizer), [(prompt, SamplingParams(max_tokens=12, seed=3, stop=[stop]))]
    )[0]
    first = next(i for i in range(len(free.token_ids)) if stop in tiny_tokenizer.decode(free.token_ids[: i + 1]))
    assert stopped.finish_reason == "stop" and stopped.stop_str == stop
    assert stopped.token_ids == free.token_ids[: first + 1]
    short = _run(TransformersBackend(model, tiny_tokenizer), [(prompt, SamplingParams(max_tokens=2, seed=3))])[0]
    assert short.token_ids == free.token_ids[:2] and (
        short.finish_reason == "length" or short.token_ids[-1] == tiny_tokenizer.eos_token_id
    )


def test_process_logits_matches_hand_values():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    lp = _process_logits(logits, temperature=2.0, top_k=-1, top_p=1.0)
    assert lp.tolist() == pytest.approx(torch.log_softmax(logits / 2, -1).tolist())
    lp = _process_logits(logits, temperature=1.0, top_k=2, top_p=1.0)
    z = math.log(math.exp(2) + math.exp(1))
    assert lp[:2].tolist() == pytest.approx([2 - z, 1 - z]) and lp[2:].tolist() == [float("-inf")] * 2
    # probabilities 0.644, 0.237, 0.087, 0.032: top_p=0.7 keeps the first two (0.644 < 0.7)
    lp = _process_logits(logits, temperature=1.0, top_k=-1, top_p=0.7)
    assert lp[:2].tolist() == pytest.approx([2 - z, 1 - z]) and math.isinf(lp[2]) and math.isinf(lp[3])
    greedy = _process_logits(logits, temperature=0.0, top_k=-1, top_p=1.0)
    assert int(torch.argmax(greedy)) == 0


def test_engine_on_the_tiny_model_keeps_invariants(model, tiny_tokenizer, enc):
    backend = TransformersBackend(model, tiny_tokenizer, max_batch_size=8)
    engine = RolloutEngine(backend, tiny_tokenizer, RolloutConfig(max_completion_length=16, max_model_len=64))
    try:
        groups = engine.run(engine.rollout([enc("q one"), enc("q two")], 3, seed=0))
        requests = engine.metrics()["rollout/requests"]
    finally:
        engine.close()
    rows = [t for g in groups for t in g]
    assert len(rows) == 6 and requests >= 6 and backend.num_batches < requests  # concurrent requests were batched
    for t in rows:
        t.check()
        assert 1 <= len(t.completion_ids) <= 16 and t.finish_reason in ("eos", "length", "call_limit", "empty_call")


def test_unwrapped_for_rollout_holds_one_unwrap(model, tiny_tokenizer, enc, monkeypatch):
    import contextlib

    import trl.models.utils

    unwraps = []

    @contextlib.contextmanager
    def counting_unwrap(m, accelerator, **kwargs):  # stands in for the ZeRO-3 gather
        unwraps.append(accelerator)
        yield m

    monkeypatch.setattr(trl.models.utils, "unwrap_model_for_generation", counting_unwrap)
    backend = TransformersBackend(model, tiny_tokenizer, accelerator="acc")
    requests = [(enc("q"), SamplingParams(max_tokens=3, seed=1))]
    _run(backend, requests)
    _run(backend, requests)
    assert unwraps == ["acc", "acc"]  # once per batch
    with backend.unwrapped_for_rollout():
        _run(backend, requests)
        _run(backend, requests)
    assert len(unwraps) == 3  # once for the whole held rollout


def test_unwrapped_for_rollout_holds_a_gathered_model(model, tiny_tokenizer, enc, monkeypatch):
    """A trainer that gathered the weights itself (ZeRO-3 / FSDP2, once per round on every rank) hands the module
    in: no unwrap (no collective) runs in the backend, and every batch decodes with that module."""
    import contextlib

    import trl.models.utils

    unwraps, used = [], []

    @contextlib.contextmanager
    def counting_unwrap(m, accelerator, **kwargs):
        unwraps.append(accelerator)
        yield m

    monkeypatch.setattr(trl.models.utils, "unwrap_model_for_generation", counting_unwrap)
    backend = TransformersBackend(object(), tiny_tokenizer, accelerator="acc", eos_token_ids=[2])
    original = backend._decode
    backend._decode = lambda m, batch: used.append(m) or original(m, batch)
    requests = [(enc("q"), SamplingParams(max_tokens=3, seed=1))]
    with backend.unwrapped_for_rollout(model) as held:
        assert held is model
        _run(backend, requests)
        _run(backend, requests)
    assert unwraps == [] and used == [model, model]


def test_top_logprobs_cost_no_scalar_per_entry(model, tiny_tokenizer, enc, monkeypatch):
    """20 top logprobs per decoded token come from two `tolist` calls, not from one 0-d tensor per entry: at most
    two scalar reads per decoded token (the sampled id and its logprob)."""
    backend = TransformersBackend(model, tiny_tokenizer)
    prompt = enc("What is 2+2?")
    _run(backend, [(prompt, SamplingParams(max_tokens=2, seed=1, logprobs=20))])  # warm-up
    reads = []
    for name in ("__float__", "__int__", "item"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _orig=orig, **k: reads.append(1) or _orig(self, *a, **k)
        )
    [seg] = _run(backend, [(prompt, SamplingParams(max_tokens=12, seed=1, logprobs=20))])
    monkeypatch.undo()
    assert len(seg.top_logprobs) == len(seg.token_ids) and all(len(t) >= 20 for t in seg.top_logprobs)
    assert len(reads) <= 2 * len(seg.token_ids), len(reads)
