"""The search cache never answers for another corpus, server or parameter set; the server identifies itself."""

from __future__ import annotations

import asyncio
import json
import types

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from appo_trl.tools.search import SearchTool, SearchToolConfig
from appo_trl.tools.search_server import BM25Index, create_app
from tests.tools.conftest import call_once

pytestmark = [pytest.mark.timeout(60), pytest.mark.network]


def _corpus(path, text):
    path.write_text(json.dumps({"id": "0", "title": "Capital", "text": text}) + "\n")
    return str(path)


def _search(cache_path, url, query="capital", **kw):
    tool = SearchTool(backend="local", url=url, cache_path=str(cache_path), retries=0, backoff_s=0.01, **kw)
    return call_once(tool, query)


def _dead_url():
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}/retrieve"


def test_restart_on_another_corpus_does_not_serve_the_old_results(tmp_path, loopback):
    cache = tmp_path / "c.sqlite"
    paris = _corpus(tmp_path / "a.jsonl", "The capital is Paris.")
    rome = _corpus(tmp_path / "b.jsonl", "The capital is Rome.")
    with loopback(create_app(BM25Index(paris))) as base:
        first = _search(cache, f"{base}/retrieve")
        again = _search(cache, f"{base}/retrieve")
    with loopback(create_app(BM25Index(rome))) as base:
        other = _search(cache, f"{base}/retrieve")
    assert first.ok and "Paris" in first.text and not first.meta["cache_hit"]
    assert again.meta["cache_hit"] and again.text == first.text  # same corpus: the cache works
    assert other.ok and "Rome" in other.text and not other.meta["cache_hit"]


def test_other_parameters_miss_and_a_dead_url_never_returns_stale_results(tmp_path, loopback):
    cache = tmp_path / "c.sqlite"
    docs = tmp_path / "d.jsonl"
    docs.write_text("".join(json.dumps({"title": f"Doc {i}", "text": f"capital number {i}"}) + "\n" for i in range(3)))
    with loopback(create_app(BM25Index(str(docs)))) as base:
        three = _search(cache, f"{base}/retrieve", max_results=3)
        one = _search(cache, f"{base}/retrieve", max_results=1)
    assert three.ok and three.meta["results"] == 3
    assert one.ok and not one.meta["cache_hit"] and one.meta["results"] == 1
    for max_results in (1, 3):
        dead = _search(cache, _dead_url(), max_results=max_results)
        assert not dead.ok and dead.error == "backend_error" and "unreachable" in dead.text


def _foreign_app():
    """Looks like `vllm serve` on port 8000: /health answers 200 with an empty body; /retrieve does not exist."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return PlainTextResponse("")

    @app.post("/retrieve")
    async def retrieve(request: Request):
        queries = (await request.json())["queries"]
        return {"result": [[{"document": {"contents": f"foreign {q}"}, "score": 1.0}] for q in queries]}

    return app


def test_client_refuses_a_server_that_is_not_ours_unless_told(tmp_path, loopback):
    with loopback(_foreign_app()) as base:
        tool = SearchTool(backend="local", url=f"{base}/retrieve", cache=False)
        with pytest.raises(ValueError, match="not an appo-trl search server"):
            tool.check()
        refused = _search(tmp_path / "c.sqlite", f"{base}/retrieve")
        allowed = _search(tmp_path / "c.sqlite", f"{base}/retrieve", check_server=False)
    assert not refused.ok and "not an appo-trl search server" in refused.text
    assert allowed.ok and "foreign capital" in allowed.text


def test_check_reports_a_missing_server_and_accepts_ours(corpus_file, loopback):
    with pytest.raises(ValueError, match="no search server at .*appo serve-search"):
        SearchTool(backend="local", url=_dead_url(), cache=False).check()
    with loopback(create_app(BM25Index(corpus_file))) as base:
        tool = SearchTool(backend="local", url=f"{base}/retrieve", cache=False)
        tool.check()
    assert tool._identity.startswith("appo-search:")


def test_defaults_leave_port_8000_to_vllm_and_keep_no_shared_cache_file(tmp_path):
    from appo_trl.configs.preflight import default_search_cache

    config = SearchToolConfig()
    assert config.url == "http://127.0.0.1:8765/retrieve"
    assert config.cache_path is None
    args = types.SimpleNamespace(tools=["python", "search"], tool_config={"search": {"max_results": 3}},
                                 output_dir=str(tmp_path / "run"))  # fmt: skip
    resolved = default_search_cache(args)
    assert resolved["search"] == {"max_results": 3, "cache_path": str(tmp_path / "run" / "search_cache.sqlite")}
    args.tool_config = {"search": {"cache_path": "/shared/mine.sqlite"}}
    assert default_search_cache(args)["search"]["cache_path"] == "/shared/mine.sqlite"


def _replay(cache_path, query="capital", **kw):
    tool = SearchTool(backend="cache", cache_path=str(cache_path), **kw)
    return call_once(tool, query)


def test_cache_only_replay_of_a_sqlite_cache_needs_the_same_parameters(tmp_path, loopback):
    cache = tmp_path / "c.sqlite"
    with loopback(create_app(BM25Index(_corpus(tmp_path / "a.jsonl", "The capital is Paris.")))) as base:
        live = _search(cache, f"{base}/retrieve", max_results=2)
    replay = _replay(cache, max_results=2)
    assert replay.ok and replay.meta["cache_hit"] and replay.text == live.text
    other = _replay(cache, max_results=5)
    assert not other.ok and other.error == "not_in_cache"


def test_seeded_entries_answer_a_live_backend_with_the_same_parameters(tmp_path, loopback):
    seed = tmp_path / "seed.json"
    seed.write_text(json.dumps({"capital": "Page 1: seeded"}))
    with loopback(create_app(BM25Index(_corpus(tmp_path / "a.jsonl", "The capital is Paris.")))) as base:
        hit = _search(tmp_path / "c.sqlite", f"{base}/retrieve", seed_path=str(seed))
    assert hit.ok and hit.meta["cache_hit"] and hit.text == "Page 1: seeded"


def test_cache_only_replay_reads_unscoped_entries(tmp_path):
    """Entries stored without scope (older cache files, `cache.put_many` as bench/tools.py does) replay as before."""
    cache = tmp_path / "c.sqlite"
    tool = SearchTool(backend="cache", cache_path=str(cache))
    tool.cache.put_many([("query number 1", "Page 1: result 1")])
    hit = _replay(cache, "Query Number 1")
    assert hit.ok and hit.meta["cache_hit"] and hit.text == "Page 1: result 1"
    tool.cache.close()


def test_a_query_arriving_while_a_batch_is_in_flight_is_answered(tmp_path, loopback):
    """A call made while the previous batch's POST is still running gets its own request (it used to wait for
    a later call to flush it, forever if none came)."""
    import threading

    app = FastAPI()
    posted = threading.Event()

    @app.get("/health")
    async def health():
        return {"service": "appo-trl-search", "corpus_fingerprint": "slow", "documents": 1}

    @app.post("/retrieve")
    async def retrieve(request: Request):
        posted.set()
        await asyncio.sleep(0.5)
        queries = (await request.json())["queries"]
        return {"result": [[{"document": {"contents": f"answer to {q}"}, "score": 1.0}] for q in queries]}

    with loopback(app) as base:
        tool = SearchTool(backend="local", url=f"{base}/retrieve", cache=False)

        async def go():
            try:
                first = asyncio.ensure_future(tool.call("first"))
                await asyncio.to_thread(posted.wait, 10)  # the first POST is in flight now
                second = await asyncio.wait_for(tool.call("second"), timeout=10)
                return await first, second
            finally:
                await tool.aclose()

        first, second = asyncio.run(go())
    assert first.text == "Page 1: answer to first" and second.text == "Page 1: answer to second"
