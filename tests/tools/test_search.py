"""Search: formatting, the BM25 server, the local client's failure modes, web adapter, cache-only replay."""

from __future__ import annotations

import asyncio
import json
import logging
import os

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from appo_trl.tools.search import NO_RESULTS, SearchTool, SearchToolConfig, WebSearchBackend, format_results
from appo_trl.tools.search_server import BM25Index, create_app
from tests.tools.conftest import call_once

pytestmark = [pytest.mark.timeout(60), pytest.mark.network]


def test_format_results_is_arpo_format():
    text = format_results(["a" * 5, "", "b", "a" * 5, "c"], max_results=2, result_length=3)
    assert text == "Page 1: aaa\nPage 2: b"
    assert format_results([]) == NO_RESULTS


# ---- the BM25 server -----------------------------------------------------------------------------
def test_index_built_once_then_reused_and_rebuilt_on_change(corpus_file):
    first = BM25Index(corpus_file)
    assert not first.reused and len(first) == 4
    assert BM25Index(corpus_file).reused
    with open(corpus_file, "a") as fh:
        fh.write(json.dumps({"contents": '"Rome"\nRome is the capital of Italy.'}) + "\n")
    again = BM25Index(corpus_file)
    assert not again.reused and len(again) == 5


def test_retrieve_protocol_batched(corpus_file, loopback):
    with loopback(create_app(BM25Index(corpus_file))) as base, httpx.Client(base_url=base) as client:
        health = client.get("/health").json()
        body = client.post("/retrieve", json={"queries": ["capital of France", "highest mountain"], "topk": 2,
                                              "return_scores": True}).json()  # fmt: skip
        plain = client.post("/retrieve", json={"queries": ["Germany"], "topk": 3}).json()
    assert health["status"] == "ok" and health["documents"] == 4 and health["service"] == "appo-trl-search"
    assert len(health["corpus_fingerprint"]) == 64
    assert len(body["result"]) == 2
    assert body["result"][0][0]["document"]["id"] == "0" and body["result"][0][0]["score"] > 0
    assert body["result"][1][0]["document"]["title"] == "Mount Everest"
    assert plain["result"][0][0]["id"] == "1"  # without scores: documents themselves (Search-R1)


def test_search_tool_against_local_server_batches_concurrent_calls(corpus_file, tmp_path, loopback):
    index = BM25Index(corpus_file)
    batches = []
    original = index.retrieve

    def counting(queries, topk):
        batches.append(len(queries))
        return original(queries, topk)

    index.retrieve = counting
    with loopback(create_app(index)) as base:
        tool = SearchTool(
            backend="local", url=f"{base}/retrieve", cache_path=str(tmp_path / "c.sqlite"), max_results=2
        )

        async def go():
            try:
                return await asyncio.gather(tool.call("capital of France"), tool.call("Guido programming language"))
            finally:
                await tool.aclose()

        paris, python = asyncio.run(go())
    assert paris.ok and paris.text.startswith('Page 1: "Paris" Paris is the capital')
    assert python.text.startswith("Page 1: Python: Python is a programming language")
    assert batches == [2]  # one HTTP request for both calls


# ---- failure modes of the local backend -------------------------------------------------------------
def _flaky_app(fail_times: int, status: int = 500, body: str | None = None, delay_s: float = 0.0):
    app = FastAPI()
    state = {"calls": 0}

    @app.get("/health")
    async def health():
        return {"status": "ok", "service": "appo-trl-search", "documents": 1, "corpus_fingerprint": "flaky"}

    @app.post("/retrieve")
    async def retrieve(request: Request):
        state["calls"] += 1
        if delay_s:
            await asyncio.sleep(delay_s)
        if state["calls"] <= fail_times:
            if body is not None:
                return PlainTextResponse(body)
            return JSONResponse({"error": "boom"}, status_code=status)
        queries = (await request.json())["queries"]
        return {"result": [[{"document": {"contents": f"answer to {q}"}, "score": 1.0}] for q in queries]}

    return app, state


def _call(url, query="q", **kw):
    tool = SearchTool(backend="local", url=url, cache=False, backoff_s=0.01, **kw)
    return call_once(tool, query)


def test_http_500_is_retried_then_succeeds(loopback):
    app, state = _flaky_app(fail_times=2)
    with loopback(app) as base:
        r = _call(f"{base}/retrieve", retries=3)
    assert r.ok and r.text == "Page 1: answer to q" and state["calls"] == 3 and r.meta["attempts"] == 3


def test_http_500_forever_gives_an_error_result(loopback):
    app, state = _flaky_app(fail_times=100)
    with loopback(app) as base:
        r = _call(f"{base}/retrieve", retries=2)
    assert not r.ok and r.error == "backend_error" and "HTTP 500" in r.text and state["calls"] == 3


def test_http_4xx_is_not_retried(loopback):
    app, state = _flaky_app(fail_times=100, status=422)
    with loopback(app) as base:
        r = _call(f"{base}/retrieve", retries=3)
    assert not r.ok and state["calls"] == 1


def test_malformed_json_is_an_error_and_not_retried(loopback):
    app, state = _flaky_app(fail_times=100, body="{not json")
    with loopback(app) as base:
        r = _call(f"{base}/retrieve", retries=3)
    assert not r.ok and "malformed" in r.text and state["calls"] == 1


def test_slow_server_times_out(loopback):
    app, state = _flaky_app(fail_times=0, delay_s=5.0)
    with loopback(app) as base:
        r = _call(f"{base}/retrieve", retries=1, timeout_s=0.2)
    assert not r.ok and "timed out" in r.text and state["calls"] == 2


def test_server_down():
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    r = _call(f"http://127.0.0.1:{port}/retrieve", retries=1)
    assert not r.ok and "unreachable" in r.text


def test_errors_are_not_cached_successes_are(tmp_path, loopback):
    app, state = _flaky_app(fail_times=1, status=503)
    with loopback(app) as base:
        tool = SearchTool(backend="local", url=f"{base}/retrieve", retries=0, cache_path=str(tmp_path / "c.sqlite"))

        async def go():
            try:
                return [await tool.call("Q one") for _ in range(3)]
            finally:
                await tool.aclose()

        first, second, third = asyncio.run(go())
    assert not first.ok and second.ok and not second.meta["cache_hit"]
    assert third.meta["cache_hit"] and third.text == second.text and state["calls"] == 2


# ---- web (Bright Data) adapter -----------------------------------------------------------------------
SECRET = "bd-key-0123456789"


def _web_tool(handler, monkeypatch, **kw):
    monkeypatch.setenv("BRIGHTDATA_API_KEY", SECRET)
    monkeypatch.setenv("BRIGHTDATA_ZONE", "serp_zone")
    config = SearchToolConfig(backend="web", cache=False, backoff_s=0.01, **kw)
    tool = SearchTool(config)
    tool.backend = WebSearchBackend(config, client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    return tool


def _run(tool, query):
    return call_once(tool, query)


def test_web_request_shape_and_parsing(monkeypatch):
    seen = []

    def handler(request: httpx.Request):
        seen.append(request)
        organic = [
            {"title": "t", "link": "l", "description": "first"},
            {"description": "first"},
            {"description": "second"},
        ]
        return httpx.Response(200, json={"organic": organic})

    r = _run(_web_tool(handler, monkeypatch), 'who "wrote" Hamlet')
    assert r.text == "Page 1: first\nPage 2: second"
    req = seen[0]
    assert str(req.url) == "https://api.brightdata.com/request"
    assert req.headers["authorization"] == f"Bearer {SECRET}"
    body = json.loads(req.content)
    assert body["zone"] == "serp_zone" and body["format"] == "raw"
    assert body["url"].startswith("https://www.bing.com/search?q=who+wrote+Hamlet&mkt=en-US&setLang=en&brd_json=1")


def test_web_needs_env_credentials(monkeypatch):
    monkeypatch.delenv("BRIGHTDATA_API_KEY", raising=False)
    with pytest.raises(ValueError, match="BRIGHTDATA_API_KEY"):
        SearchTool(backend="web", cache=False)


def test_web_secret_never_in_logs_or_results(monkeypatch, caplog):
    calls = {"n": 0}

    def handler(request: httpx.Request):
        calls["n"] += 1
        if calls["n"] == 1:
            raise httpx.ConnectError(f"refused while sending {request.headers['authorization']}")
        if calls["n"] == 2:
            return httpx.Response(503, text=f"upstream error for {request.headers['authorization']}")
        return httpx.Response(401, json={"error": f"bad key {request.headers['authorization']}"})

    caplog.set_level(logging.DEBUG)
    tool = _web_tool(handler, monkeypatch, retries=3)
    assert SECRET not in repr(tool.backend)
    r = _run(tool, "anything")
    assert not r.ok and calls["n"] == 3  # connect error and 503 retried, 401 not
    assert SECRET not in json.dumps(r.to_dict())
    assert all(SECRET not in rec.getMessage() for rec in caplog.records)


def test_web_rate_limit_spaces_requests(monkeypatch):
    stamps = []

    def handler(request):
        import time

        stamps.append(time.monotonic())
        return httpx.Response(200, json={"organic": [{"description": "x"}]})

    tool = _web_tool(handler, monkeypatch, rate_limit_per_s=2.0)

    async def go():
        try:
            await asyncio.gather(*(tool.call(f"q{i}") for i in range(4)))
        finally:
            await tool.aclose()

    asyncio.run(go())
    # a bucket of 2 tokens refilled at 2/s: the 4th request cannot start before ~1 s after the first
    assert stamps[3] - stamps[0] >= 0.9


# ---- cache-only replay of ARPO's cache ------------------------------------------------------------------
def test_cache_backend_replays_arpo_json(arpo_data_dir):
    path = os.path.join(arpo_data_dir, "search_cache.json")
    with open(path) as fh:
        query, value = next(iter(json.load(fh).items()))
    tool = SearchTool(backend="cache", cache_path=path)
    hit = _run(tool, f'  "{query.upper()}" ')
    assert hit.ok and hit.text == value and hit.text.startswith("Page 1: ") and hit.meta["cache_hit"]
    miss = _run(SearchTool(backend="cache", cache_path=path), "a query nobody ever searched for 12345")
    assert not miss.ok and miss.error == "not_in_cache" and miss.text.startswith("Not in cache")


def test_bad_backend_name_suggests():
    with pytest.raises(ValueError, match="Did you mean 'local'"):
        SearchToolConfig(backend="locale")


def test_same_tool_across_event_loops(corpus_file, loopback, tmp_path):
    # evaluation code may call asyncio.run once per batch with one tool: clients must not outlive their loop
    with loopback(create_app(BM25Index(corpus_file))) as base:
        tool = SearchTool(backend="local", url=f"{base}/retrieve", cache=False)
        first = asyncio.run(tool.call("capital of France"))
        second = asyncio.run(tool.call("capital of Germany"))
        asyncio.run(tool.aclose())
    assert first.ok and second.ok and "Berlin" in second.text


def test_appo_serve_search_and_appo_tool_search_offline(corpus_file, tmp_path):
    """The offline path end to end: `appo serve-search` in its own process, `appo tool search` against it."""
    import socket
    import subprocess
    import sys
    import time

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = subprocess.Popen(
        [sys.executable, "-m", "appo_trl.cli", "serve-search", "--corpus", corpus_file, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert any("4 documents, index built" in line for line in iter(server.stdout.readline, ""))
        url = f"http://127.0.0.1:{port}"
        while True:
            try:
                if httpx.get(f"{url}/health", trust_env=False).json()["documents"] == 4:
                    break
            except httpx.TransportError:
                assert server.poll() is None, "appo serve-search died"
                time.sleep(0.05)
        cache = str(tmp_path / "cache.sqlite")
        cmd = [sys.executable, "-m", "appo_trl.cli", "tool", "search", "highest mountain", "--url", f"{url}/retrieve"]
        done = subprocess.run([*cmd, "--cache-path", cache], capture_output=True, text=True, timeout=60)
        out = json.loads(done.stdout.strip().splitlines()[-1])
        assert done.returncode == 0 and out["ok"] and out["text"].startswith("Page 1: Mount Everest")
    finally:
        server.terminate()
        server.wait(30)
    # the server is gone: the same query now replays from the cache, fully offline
    done = subprocess.run(
        [sys.executable, "-m", "appo_trl.cli", "tool", "search", "HIGHEST mountain", "--backend", "cache",
         "--cache-path", cache],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    replay = json.loads(done.stdout)
    assert replay["ok"] and replay["meta"]["cache_hit"] and replay["text"] == out["text"]
