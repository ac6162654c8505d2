"""Loopback HTTP servers for the search tests (uvicorn in a thread, on a socket bound to 127.0.0.1:0)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import pytest


@contextlib.contextmanager
def serve(app):
    """Run an ASGI app on 127.0.0.1 (random port) in a thread; yields the base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("test server failed to start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture
def loopback():
    """`with loopback(app) as base_url:` runs an ASGI app on 127.0.0.1 for the duration of the block."""
    return serve


@pytest.fixture
def corpus_file(tmp_path):
    docs = [
        {"id": "0", "contents": '"Paris"\nParis is the capital and largest city of France.'},
        {"id": "1", "contents": '"Berlin"\nBerlin is the capital of Germany.'},
        {"id": "2", "title": "Mount Everest", "text": "Mount Everest is the highest mountain above sea level."},
        {"id": "3", "title": "Python", "text": "Python is a programming language created by Guido van Rossum."},
    ]
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    return str(path)


@contextlib.contextmanager
def running_python_tool(config):
    """A started `PythonTool` (zygote up), closed on exit."""
    import asyncio

    from appo_trl.tools.python_sandbox import PythonTool

    tool = PythonTool(config)
    tool.start()
    try:
        yield tool
    finally:
        asyncio.run(tool.aclose())


def assert_alive(tool, code):
    """The sandbox still answers an innocent call after `code` ran."""
    import asyncio

    after = asyncio.run(tool.call("print(6*7)"))
    assert after.ok and after.text == "42", f"sandbox broken after {code!r}: {after}"


def call_once(tool, query):
    """One `tool.call(query)` in a fresh event loop, closing the tool afterwards."""
    import asyncio

    async def go():
        try:
            return await tool.call(query)
        finally:
            await tool.aclose()

    return asyncio.run(go())
