"""`appo_trl.vllm`'s `ServerSpec`, resolved once from a config, and the one `ServerClient` of a server.

Pinned: the URL rule (`vllm_server_base_url`, else TRL's host:port) in one place; `resolve_servers` against the fake
vLLM server (health, the served length read and checked); the sampler built from the spec.
"""

from __future__ import annotations

import os
import socket
import sys
from types import SimpleNamespace

import pytest

from appo_trl.vllm import ServerClient, ServerSpec, VLLMServerBackend, WeightSyncError, resolve_servers, server_urls

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
fake_vllm = pytest.importorskip("bench.fake_vllm")


def _args(**kw):
    base = dict(vllm_server_base_url=None, vllm_server_host="10.0.0.7", vllm_server_port=8123,
                vllm_server_timeout=10, vllm_max_model_length=None)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_server_urls_read_the_base_url_else_trls_host_and_port():
    assert server_urls(_args()) == ["http://10.0.0.7:8123"]
    assert server_urls(_args(vllm_server_base_url="http://a:1/")) == ["http://a:1"]
    assert server_urls(_args(vllm_server_base_url="http://a:1, http://b:2")) == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="lists a replica twice"):
        server_urls(_args(vllm_server_base_url="http://a:1,http://a:1"))


def test_spec_without_replicas_samples_from_its_one_server():
    spec = ServerSpec(["http://a:1"], max_model_len=2048)
    assert (spec.url, spec.router_url) == ("http://a:1", None)
    backend = spec.backend(max_concurrency=7, timeout_s=3.0)
    assert isinstance(backend, VLLMServerBackend) and backend.base_url == "http://a:1"
    assert (backend.max_concurrency, backend.timeout_s) == (7, 3.0)
    spec.close()  # nothing to stop


def test_resolve_servers_waits_for_health_and_reads_the_served_length(tiny_tokenizer):
    policy = fake_vllm.ScriptedPolicy(tiny_tokenizer, lambda ctx, rng: [tiny_tokenizer.eos_token_id])
    with fake_vllm.FakeVLLMServer(policy, tiny_tokenizer, max_model_len=1024) as server:
        spec = resolve_servers(_args(vllm_server_base_url=server.url))
        assert (spec.urls, spec.replicas, spec.max_model_len, spec.url) == ([server.url], None, 1024, server.url)
        with pytest.raises(ValueError, match=r"vllm_max_model_length=4096 .* max_model_len=1024"):
            resolve_servers(_args(vllm_server_base_url=server.url, vllm_max_model_length=4096))
        client = ServerClient(server.url)
        assert client.probe() is None and client.device() == "cpu"
        assert client.resolve_max_model_len(None) == ("fake-model", 1024)


def test_a_server_that_never_answers_is_one_error_naming_it():
    url = f"http://127.0.0.1:{_free_port()}"
    assert ServerClient(url).probe(timeout_s=1.0).startswith("ConnectError")
    with pytest.raises(WeightSyncError, match=rf"vLLM server at {url} not healthy after 0 s"):
        ServerClient(url).wait_healthy(0.2, interval_s=0.05)
