"""A vLLM server that is not there at start-up: one line while waiting, then one error naming the URL and
`vllm_server_timeout` (and how to change it); a port that answers HTTP but is not vLLM fails at once."""

from __future__ import annotations

import http.server
import logging
import threading
import time
from types import SimpleNamespace

import pytest

from appo_trl.vllm import ServerNotReadyError, resolve_servers


def _args(url: str, timeout: float = 1.5) -> SimpleNamespace:
    return SimpleNamespace(vllm_server_base_url=url, vllm_server_host="127.0.0.1", vllm_server_port=1,
                           vllm_server_timeout=timeout, vllm_max_model_length=None, vllm_router_policy="round_robin",
                           vllm_router_port=None)  # fmt: skip


@pytest.fixture
def http_server():
    """A plain HTTP server: `/health` answers 200 when `healthy` is set, 404 otherwise (not vLLM)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        healthy = False

        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.healthy and self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, Handler, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_dead_server_one_line_while_waiting_then_error_naming_url_and_field(caplog):
    start = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(ServerNotReadyError) as err:
        resolve_servers(_args("http://127.0.0.1:1"))
    assert time.monotonic() - start < 5
    msg = str(err.value)
    assert "http://127.0.0.1:1" in msg and "vllm_server_timeout=1.5 s" in msg and "--vllm_server_timeout" in msg
    waiting = [r.getMessage() for r in caplog.records if "waiting for the vLLM server" in r.getMessage()]
    assert len(waiting) == 1 and "http://127.0.0.1:1" in waiting[0] and "vllm_server_timeout" in waiting[0]


def test_plain_http_server_is_not_vllm_and_fails_at_once(http_server):
    _, _, url = http_server
    start = time.monotonic()
    with pytest.raises(ServerNotReadyError, match="is not a vLLM server"):
        resolve_servers(_args(url, timeout=30))
    assert time.monotonic() - start < 5


def test_replica_list_with_one_dead_url_names_the_dead_one(http_server):
    _, handler, url = http_server
    handler.healthy = True
    with pytest.raises(ServerNotReadyError) as err:
        resolve_servers(_args(f"{url},http://127.0.0.1:1"))
    assert "http://127.0.0.1:1 not healthy" in str(err.value) and url not in str(err.value)
