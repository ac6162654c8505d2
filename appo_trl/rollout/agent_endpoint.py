"""The agent endpoint: an OpenAI-compatible HTTP server in front of a sampler, one base URL per trajectory.

`AgentEndpoint` serves `POST <base>/chat/completions` and `GET <base>/models`, where every agent run gets its own
`<base> = http://HOST:PORT/<secret>/<session>/v1` (`open_session`), so `openai.OpenAI(base_url=..., api_key="-")`
works unchanged and each request lands in its run's `AgentSession` (exact ids, forks: `agent_session`). The secret
is drawn per endpoint (per training run): another local process cannot guess a URL. The server (uvicorn, on its
own thread and event loop) hands each backend call to `submit` (the rollout engine's loop) and answers when it is
done. A body is checked before anything is rendered (`agent_request`: over `max_body_bytes` a 413, a bad or
unsupported field a 400 naming it; never a traceback in the log); sampling settings are the trainer's, and a request
asking for others is answered with the trainer's (one warning per endpoint). `tool_choice: none` answers text without parsing calls; `required` or a named function
cannot be forced without constraining the policy, so it is sampled unconstrained (one warning per endpoint). It
binds 127.0.0.1 unless told otherwise; another host keeps the secret in the path. `stream: true` is answered with
OpenAI's server-sent-event chunks once the turn is sampled (`agent_stream`): the row is the sampler's either way.

What it does not do: run agents, build training rows out of sessions or score them (`appo_trl.trainer.agents`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Coroutine

from appo_trl.rollout.agent_request import ChatRequest, RequestError, loads, parse_request
from appo_trl.rollout.agent_session import AgentSession, ChatRenderer, RequestTooLong
from appo_trl.rollout.agent_stream import sse_events
from appo_trl.rollout.types import SamplingParams

logger = logging.getLogger(__name__)

_SECRETS: set[str] = set()  # every endpoint secret drawn in this process, a closed endpoint's too (`redact`)
_BYTES_PER_TOKEN = 64  # the body cap per token of max_model_len: JSON-escaped text is rarely over 12 bytes a token
_BACKEND_S: contextvars.ContextVar[list[float]] = contextvars.ContextVar("agent_backend_s")  # per request


def _error(status: int, message: str, kind: str = "invalid_request_error"):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class AgentEndpoint:
    """An OpenAI-compatible endpoint whose every base URL is one agent run (see the module head).

    Args:
        submit: `submit(coroutine) -> concurrent.futures.Future`: runs a backend call on the sampler's event loop
            (`RolloutEngine.submit`).
        generate: `async (prompt_ids, SamplingParams) -> Segment`, the backend's `generate`.
        renderer: the policy's `ChatRenderer`.
        params: the trainer's sampling settings (`max_tokens` = the row budget, `max_completion_length`).
        max_model_len: the sampler's context length.
        model_name: the id `GET /v1/models` lists.
        host, port: where to listen (port 0: any free port).
        concurrency: most backend calls in flight from this endpoint.
        max_body_bytes: the largest request body read (larger: HTTP 413 before parsing); default 64 bytes per token
            of `max_model_len`, at least 1 MiB.
    """

    def __init__(self, submit: Callable[[Coroutine], concurrent.futures.Future], generate, renderer: ChatRenderer,
                 params: SamplingParams, max_model_len: int, model_name: str = "policy", host: str = "127.0.0.1",
                 port: int = 0, concurrency: int = 64, max_body_bytes: int | None = None):  # fmt: skip
        self._submit, self._generate, self.renderer = submit, generate, renderer
        self.params, self.max_model_len, self.model_name = params, max_model_len, model_name
        self.host, self.secret = host, secrets.token_urlsafe(16)
        _SECRETS.add(self.secret)
        self._sessions: dict[str, AgentSession] = {}
        self._concurrency = concurrency
        self.max_body_bytes = max_body_bytes or max(2**20, _BYTES_PER_TOKEN * max_model_len)
        self._warned = self._warned_choice = self._warned_unknown = False
        self.reset_metrics()
        # IPPROTO_TCP spelled out: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say so (uvloop always
        # does), and an answer's head and body are two writes: with Nagle on, the body waits out the client's
        # delayed ACK, 40 ms per call (measured: uvicorn without uvloop)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self.url_host = _reachable(host)  # the host agents are given: a wildcard bind is no address to connect to
        if host not in ("127.0.0.1", "localhost", "::1"):
            logger.warning("agent endpoint listens on %s:%d; its URLs carry the run's secret, keep them private",
                           host, self.port)  # fmt: skip
        self._server = None
        self._thread: threading.Thread | None = None
        self._sem: asyncio.Semaphore | None = None

    # ---- lifetime ----------------------------------------------------------------------------------------------
    def start(self) -> AgentEndpoint:
        """Start serving on a daemon thread; returns when the server accepts connections."""
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route

        route = "/{secret}/{key}/v1/{rest:path}"
        app = Starlette(routes=[Route(route, self._handle, methods=["GET", "POST"])])
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, timeout_keep_alive=30,
                                timeout_graceful_shutdown=5)  # fmt: skip
        self._server = uvicorn.Server(config)
        # its own thread and loop (uvloop when installed): serving on the engine's asyncio loop saves the hop between
        # the loops but measured slower (docs/benchmarks.md, "Agent endpoint")
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="appo-agent-endpoint", daemon=True)  # fmt: skip
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agent endpoint did not start")
            time.sleep(0.005)
        return self

    def close(self) -> None:
        """Stop the server, end every session and free the socket (idempotent)."""
        for session in self._sessions.values():
            session.closed = True
        self._sessions.clear()
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None
        self._sock.close()

    # ---- sessions ----------------------------------------------------------------------------------------------
    def open_session(self, seed: int = 0, group: int = 0, session_id: str | None = None) -> tuple[str, AgentSession]:
        """A new agent run: its base URL (ends in `/v1`) and its `AgentSession`."""
        key = secrets.token_hex(8)
        params = SamplingParams(max_tokens=self.params.max_tokens, temperature=self.params.temperature,
                                top_p=self.params.top_p, top_k=self.params.top_k, session_id=session_id,
                                logprobs=self.params.logprobs)  # fmt: skip
        session = AgentSession(self.renderer, self._sample, params, self.max_model_len, seed=seed, group=group)
        self._sessions[key] = session
        return self.base_url(key), session

    def end_session(self, base_url: str) -> None:
        """Stop answering the run of `base_url` (its later requests get HTTP 410)."""
        key = base_url.rstrip("/").split("/")[-2]
        session = self._sessions.pop(key, None)
        if session is not None:
            session.closed = True

    def base_url(self, key: str) -> str:
        host = self.url_host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/{self.secret}/{key}/v1"

    # ---- metrics -----------------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """`agent/requests`, `agent/overhead_ms_mean` (time in the endpoint beyond the backend call)."""
        m = self._m
        n = m["requests"]
        return {"agent/requests": n, "agent/overhead_ms_mean": 1000 * m["overhead_s"] / n if n else 0.0}

    def reset_metrics(self) -> None:
        self._m = {"requests": 0.0, "overhead_s": 0.0}
        self.overheads_s: list[float] = []

    # ---- serving -----------------------------------------------------------------------------------------------
    async def _sample(self, prompt_ids, params):
        """The backend call on the sampler's loop, at most `concurrency` in flight; its wall time is noted."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self._concurrency)
        async with self._sem:
            start = time.perf_counter()
            try:
                return await asyncio.wrap_future(self._submit(self._generate(prompt_ids, params)))
            finally:
                spent = _BACKEND_S.get(None)
                if spent is not None:
                    spent[0] += time.perf_counter() - start

    async def _handle(self, request):
        from starlette.responses import JSONResponse

        p = request.path_params
        if not secrets.compare_digest(p["secret"].encode(), self.secret.encode()):  # bytes: any path text
            return _error(404, "not found", "not_found_error")
        rest = p["rest"].strip("/")
        if request.method == "GET" and rest == "models":
            return JSONResponse({"object": "list", "data": [
                {"id": self.model_name, "object": "model", "created": 0, "owned_by": "appo-trl"}]})  # fmt: skip
        if request.method != "POST" or rest != "chat/completions":
            return _error(404, f"{request.method} /v1/{rest} is not served (only chat/completions and models)")
        session = self._sessions.get(p["key"])
        if session is None or session.closed:
            return _error(410, "this agent run has ended (it timed out, failed, or its round is over)")
        response = await self._chat(request, session)
        if 400 <= response.status_code < 500 and response.status_code != 410:  # the run learns why it has no row
            session.refusals.append(f"HTTP {response.status_code}: {json.loads(response.body)['error']['message']}")
        return response

    async def _chat(self, request, session: AgentSession):
        """The answer to one `chat/completions` request of `session`'s run (an error response: why not)."""
        from starlette.requests import ClientDisconnect
        from starlette.responses import JSONResponse

        try:
            raw = await self._read_body(request)
        except ClientDisconnect:  # the agent went away mid-body (cancelled, timed out): nobody reads an answer
            return _error(400, "the client disconnected before sending the whole body")
        if raw is None:
            return _error(413, f"the request body is over {self.max_body_bytes} bytes, the most the agent endpoint "
                               f"reads (the model's max_model_len is {self.max_model_len} tokens)")  # fmt: skip
        try:
            req = parse_request(loads(raw))
        except RequestError as exc:
            return _error(400, str(exc))
        self._warn_settings(req)
        body = req.model_dump(exclude_none=True)
        start, backend = time.perf_counter(), [0.0]
        _BACKEND_S.set(backend)
        try:
            answer = await session.complete(body)
        except RequestTooLong as exc:
            return _error(400, str(exc), "context_length_exceeded")
        except (ValueError, TypeError, KeyError) as exc:
            return _error(400, f"{type(exc).__name__}: {exc}")
        except RecursionError:  # `parse_request` bounds nesting; a template recursing on its own is the same to us
            return _error(400, "the chat template recursed too deep rendering this request")
        except RuntimeError as exc:
            return _error(410 if session.closed else 500, str(exc), "server_error")
        except Exception as exc:  # a backend failure: one line in the log, not a traceback wall; the agent sees 500
            logger.warning("agent endpoint: a request failed: %s: %s", type(exc).__name__, exc)
            logger.debug("agent endpoint request failure", exc_info=True)
            return _error(500, f"{type(exc).__name__}: {exc}", "server_error")
        answer["model"] = self.model_name
        spent = time.perf_counter() - start
        overhead = max(spent - backend[0], 0.0)  # the endpoint's own time: parsing, rendering, answering
        self._m["requests"] += 1
        self._m["overhead_s"] += overhead
        self.overheads_s.append(overhead)
        if req.stream:  # sampled in full above: the stream replays the answer, the row is the sampler's
            from starlette.responses import StreamingResponse

            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(iter(sse_events(answer, include_usage)), media_type="text/event-stream")
        return JSONResponse(answer)

    async def _read_body(self, request) -> bytes | None:
        """The body, or None once it is over `max_body_bytes` (read no further: a huge body never reaches memory
        whole, let alone the tokenizer)."""
        try:
            if int(request.headers.get("content-length") or 0) > self.max_body_bytes:
                return None
        except ValueError:
            pass
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > self.max_body_bytes:
                return None
            parts.append(part)
        return b"".join(parts)

    def _warn_settings(self, req: ChatRequest) -> None:
        """One warning per run for each kind of request setting the endpoint does not follow."""
        choice = req.tool_choice
        if not self._warned_choice and (choice == "required" or isinstance(choice, dict)):
            self._warned_choice = True
            logger.warning(
                "agent requests ask for tool_choice=%s; the training endpoint cannot force a tool call (constrained "
                "decoding would train on tokens the policy did not choose): it samples unconstrained and answers a "
                "turn without a call as text (this warning is shown once per run)", json.dumps(choice),
            )  # fmt: skip
        if req.unknown and not self._warned_unknown:
            self._warned_unknown = True
            logger.warning("agent requests carry fields the training endpoint does not know and ignores: %s (this "
                           "warning is shown once per run)", ", ".join(req.unknown))  # fmt: skip
        if self._warned:
            return
        mine = {"temperature": self.params.temperature, "top_p": self.params.top_p, "top_k": self.params.top_k,
                "presence_penalty": 0.0, "frequency_penalty": 0.0}  # fmt: skip
        differ = {k: getattr(req, k) for k in mine if getattr(req, k) is not None and getattr(req, k) != mine[k]}
        if req.seed is not None:
            differ["seed"] = req.seed
        if differ:
            self._warned = True
            logger.warning(
                "agent requests asked for %s; the training endpoint samples with the trainer's settings (%s) and "
                "its own per-run seeds, as every rollout does (this warning is shown once per run)",
                ", ".join(f"{k}={v}" for k, v in differ.items()),
                ", ".join(f"{k}={v}" for k, v in list(mine.items())[:3]),
            )  # fmt: skip


def _reachable(host: str) -> str:
    """`host`, or for a wildcard bind (`0.0.0.0`, `::`, empty) this machine's address on its default route (what
    agents in sandboxes on other hosts can reach), else loopback."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    family, probe, loopback = ((socket.AF_INET6, ("2001:db8::1", 9), "::1") if host == "::" else
                               (socket.AF_INET, ("192.0.2.1", 9), "127.0.0.1"))  # fmt: skip
    try:  # a UDP connect picks the outgoing interface and sends nothing (the probe is a documentation address)
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(probe)
            address = s.getsockname()[0]
    except OSError:
        return loopback
    return address if address not in ("0.0.0.0", "::") else loopback


def drawn_secrets() -> frozenset[str]:
    """The per-run secrets of every endpoint made in this process (an error quoting a URL may outlive its endpoint)."""
    return frozenset(_SECRETS)


def redact(text: str) -> str:
    """`text` with every endpoint secret of this process replaced by `***` (for logs and error lines)."""
    for secret in _SECRETS:
        text = text.replace(secret, "***")
    return text


__all__ = ["AgentEndpoint", "drawn_secrets", "redact"]
