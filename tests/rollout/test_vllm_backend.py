"""`VLLMServerBackend` against the loopback fake vLLM 0.31 server: JSON both ways, failures, the full loop."""

from __future__ import annotations

import math
import socket

import pytest

from appo_trl.rollout import RolloutConfig, RolloutEngine, SamplingParams, TransformersBackend
from appo_trl.vllm.server import VLLMServerBackend, VLLMServerError, parse_choice
from bench.fake_vllm import FakeVLLMServer, ScriptedPolicy
from tests.rollout.conftest import ScriptedTool, generate_once
from tests.rollout.test_engine import by_results, lp, same

pytestmark = pytest.mark.network


_gen = generate_once


@pytest.fixture
def scripted_server(tiny_tokenizer, enc):
    eos = tiny_tokenizer.eos_token_id
    turns = [enc("<python>print(1)</python>") + enc(" after"), enc("<answer>1</answer>") + [eos]]
    policy = ScriptedPolicy(tiny_tokenizer, by_results(tiny_tokenizer, turns))
    with FakeVLLMServer(policy, tiny_tokenizer) as server:
        yield server, policy, turns


def test_request_and_response_fields(scripted_server, enc):
    server, policy, turns = scripted_server
    prompt = enc("question")
    backend = VLLMServerBackend(server.url)
    seg = _gen(backend, prompt, SamplingParams(max_tokens=50, seed=11, stop=["</python>"], logprobs=3))
    body = server.bodies[-1]
    assert body["prompt"] == [prompt] and body["n"] == 1 and body["model"] == "fake-model"
    assert body["return_token_ids"] is True and body["return_tokens_as_token_ids"] is True
    assert body["include_stop_str_in_output"] is True and body["stop"] == ["</python>"]
    assert body["seed"] == 11 and body["logprobs"] == 3 and body["max_tokens"] == 50
    expected = enc("<python>print(1)</python>")
    assert seg.token_ids == expected and seg.finish_reason == "stop" and seg.stop_str == "</python>"
    assert seg.logprobs == [lp(len(prompt) + i) for i in range(len(expected))]
    assert all(top[t] == x and len(top) == 4 for top, t, x in zip(seg.top_logprobs, seg.token_ids, seg.logprobs))


def test_parse_choice_finish_reasons():
    lps = {"token_logprobs": [-0.5, -0.25], "tokens": ["token_id:7", "token_id:2"],
           "top_logprobs": [{"token_id:9": -0.1, "token_id:7": -0.5}, {"token_id:2": -0.25}]}  # fmt: skip
    eos = parse_choice({"token_ids": [7, 2], "logprobs": lps, "finish_reason": "stop", "stop_reason": None}, True)
    assert eos.finish_reason == "eos" and eos.stop_str is None
    assert eos.logprobs == [-0.5, -0.25] and eos.top_logprobs == [{9: -0.1, 7: -0.5}, {2: -0.25}]
    stop = parse_choice(
        {"token_ids": [7, 2], "logprobs": lps, "finish_reason": "stop", "stop_reason": "</search>"}, False
    )
    assert stop.finish_reason == "stop" and stop.stop_str == "</search>" and stop.top_logprobs is None
    length = parse_choice(
        {"token_ids": [7, 2], "logprobs": lps, "finish_reason": "length", "stop_reason": None}, False
    )
    assert length.finish_reason == "length"
    bad = dict(lps, tokens=["token_id:8", "token_id:2"])
    with pytest.raises(VLLMServerError, match="do not match"):
        parse_choice({"token_ids": [7, 2], "logprobs": bad, "finish_reason": "length"}, False)
    nan = parse_choice({"token_ids": [7], "logprobs": {"token_logprobs": [None]}, "finish_reason": "length"}, False)
    assert math.isnan(nan.logprobs[0])


def test_server_down_names_the_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    backend = VLLMServerBackend(f"http://127.0.0.1:{port}", model="m", max_retries=1, backoff_s=0.01)
    with pytest.raises(
        VLLMServerError, match=rf"127\.0\.0\.1:{port}/v1/completions failed after 2 attempts: unreachable"
    ):
        _gen(backend, [1, 2], SamplingParams(max_tokens=4))


def test_500s_are_retried_then_reported(scripted_server, enc):
    server, _, _ = scripted_server
    server.fail_next = 2
    backend = VLLMServerBackend(server.url, max_retries=2, backoff_s=0.01)
    seg = _gen(backend, enc("q"), SamplingParams(max_tokens=50, stop=["</python>"]))
    assert seg.finish_reason == "stop" and backend.num_retries == 2
    server.fail_next = 5
    backend = VLLMServerBackend(server.url, model="fake-model", max_retries=1, backoff_s=0.01)
    with pytest.raises(VLLMServerError, match="HTTP 500"):
        _gen(backend, enc("q"), SamplingParams(max_tokens=50))


def test_slow_server_times_out(scripted_server, enc):
    server, _, _ = scripted_server
    server.extra_delay_s = 2.0
    backend = VLLMServerBackend(server.url, model="fake-model", timeout_s=0.2, max_retries=0)
    with pytest.raises(
        VLLMServerError, match=r"timed out: no answer within vllm_request_timeout_s=0.2 s \(ReadTimeout\)"
    ):
        _gen(backend, enc("q"), SamplingParams(max_tokens=50))


def test_engine_over_http_matches_direct_policy(scripted_server, tiny_tokenizer, enc):
    server, policy, turns = scripted_server
    tools = {"python": ScriptedTool("python", lambda q: "1")}
    cfg = RolloutConfig(max_completion_length=256, max_model_len=512)
    engine = RolloutEngine(VLLMServerBackend(server.url), tiny_tokenizer, cfg, tools)
    direct = RolloutEngine(
        ScriptedPolicy(tiny_tokenizer, by_results(tiny_tokenizer, turns)), tiny_tokenizer, cfg, tools
    )
    try:
        prompts = [enc("q one"), enc("q two")]
        over_http = engine.run(engine.rollout(prompts, 3, seed=4))
        local = direct.run(direct.rollout(prompts, 3, seed=4))
    finally:
        engine.close()
        direct.close()
    for a, b in zip(sum(over_http, []), sum(local, [])):
        assert a.completion_ids == b.completion_ids and a.loss_mask == b.loss_mask and same(a.logprobs, b.logprobs)
        assert a.finish_reason == "eos" and a.num_calls == 1
    seeds = [b["seed"] for b in server.bodies]
    assert len(seeds) == 12 and len(set(seeds)) == 12


def test_capacity_knob_bounds_running_sequences(tiny_tokenizer, enc):
    eos = tiny_tokenizer.eos_token_id
    policy = ScriptedPolicy(tiny_tokenizer, lambda ctx, rng: enc(" the of") + [eos])
    with FakeVLLMServer(policy, tiny_tokenizer, decode_step_s=0.01, max_num_seqs=3) as server:
        engine = RolloutEngine(VLLMServerBackend(server.url), tiny_tokenizer, RolloutConfig(max_completion_length=32))
        try:
            groups = engine.run(engine.rollout([enc("q")], 8, seed=0))
        finally:
            engine.close()
        assert len(groups[0]) == 8 and server.max_running == 3


def test_fake_server_driven_by_the_tiny_model(tiny_model_path, tiny_tokenizer, enc):
    """The HTTP path and the in-process path give the same tokens and logprobs for the same seeds."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    cfg = RolloutConfig(max_completion_length=12, max_model_len=256, record_entropies=True)
    with FakeVLLMServer(TransformersBackend(model, tiny_tokenizer, max_batch_size=1), tiny_tokenizer) as server:
        engine = RolloutEngine(VLLMServerBackend(server.url), tiny_tokenizer, cfg)
        direct = RolloutEngine(TransformersBackend(model, tiny_tokenizer, max_batch_size=1), tiny_tokenizer, cfg)
        try:
            a = engine.run(engine.rollout([enc("What is 1 plus 2?")], 2, seed=3))[0]
            b = direct.run(direct.rollout([enc("What is 1 plus 2?")], 2, seed=3))[0]
        finally:
            engine.close()
            direct.close()
    for x, y in zip(a, b):
        assert x.completion_ids == y.completion_ids and len(x.completion_ids) > 0
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-6)
        assert x.entropies == pytest.approx(y.entropies, abs=1e-6)
