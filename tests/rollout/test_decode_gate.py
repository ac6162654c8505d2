"""The in-process sampler's in-flight update (`appo_trl.rollout.decode_gate.DecodeGate` in `TransformersBackend`):
a sequence decoding on a copy of the tiny model is held between two decode steps while the copy takes new
weights, then goes on. Every token carries the version of the step that sampled it; the tokens before the swap
have the old weights' logprobs, those after it the new weights' over the old KV cache of the prefix (`keep`) or a
plain forward of the new weights (`abort`), each within `TOL` of transformers' own forward."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from appo_trl.rollout.decode_gate import DecodeGate
from appo_trl.rollout.transformers_backend import TransformersBackend
from appo_trl.rollout.types import SamplingParams
from appo_trl.vllm.inflight import PolicyClock
from tests.rollout.reference_logps import TOL, kept_cache_logps, plain_logps, worst

MAX_TOKENS = 120


def decode_across_a_swap(tiny_model_path, tiny_tokenizer, mode: str, swap_at: int = 30):
    old = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    new = copy.deepcopy(old)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    sampler, clock = copy.deepcopy(old), PolicyClock(0)
    gate = DecodeGate(clock, mode)
    backend = TransformersBackend(sampler, tiny_tokenizer, eos_token_ids=[-1], gate=gate)  # never ends early
    prompt = tiny_tokenizer("What is 17 plus 25?", add_special_tokens=False)["input_ids"]
    out = {}
    thread = threading.Thread(target=lambda: out.update(seg=asyncio.run(backend.generate(
        prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3)))))  # fmt: skip
    thread.start()
    while gate.steps < swap_at:
        time.sleep(0.001)
    with gate.paused():
        held = gate.steps
        sampler.load_state_dict(new.state_dict())
        clock.advance(1)
    thread.join(60)
    return out["seg"], prompt, old, new, held


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_swap_between_decode_steps_keeps_each_tokens_version_and_logprobs(tiny_model_path, tiny_tokenizer, mode):
    seg, prompt, old, new, held = decode_across_a_swap(tiny_model_path, tiny_tokenizer, mode)
    ids = seg.token_ids
    (v0, b), (v1, after) = seg.version_runs
    assert (v0, v1) == (0, 1) and b == held and b >= 30 and b + after == len(ids) == MAX_TOKENS
    assert worst(seg.logprobs[:b], plain_logps(old, prompt, ids[:b])) < TOL  # sampled on the old weights
    kept, fresh = kept_cache_logps(old, new, prompt, ids, b), plain_logps(new, prompt, ids)[b:]
    right, other = (kept, fresh) if mode == "keep" else (fresh, kept)
    print(f"{mode}: before {worst(seg.logprobs[:b], plain_logps(old, prompt, ids[:b])):.2e}, after "
          f"{worst(seg.logprobs[b:], right):.2e} (the other reference: {worst(seg.logprobs[b:], other):.2e})")  # fmt: skip
    assert worst(seg.logprobs[b:], right) < TOL and worst(seg.logprobs[b:], other) > 10 * TOL


def test_without_a_gate_no_versions_and_a_bad_mode_is_refused(tiny_model_path, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    seg = asyncio.run(TransformersBackend(model, tiny_tokenizer).generate([5, 6, 7], SamplingParams(max_tokens=4)))
    assert seg.version_runs == []
    with pytest.raises(ValueError, match="in-process inflight_update must be one of"):
        DecodeGate(PolicyClock(0), "wait")
