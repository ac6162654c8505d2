"""`VLLMServerBackend`: sampling from a running `vllm serve` over HTTP (`POST /v1/completions`).

One request per `generate` call: a token-id prompt, `n=1`, its own seed, `return_token_ids` for the exact sampled
ids, `logprobs` for the sampled token's logprob (plus top-k when asked), the tool stop strings kept whole
(`include_stop_str_in_output`); `SamplingParams.session_id` goes out as `X-Session-ID`, so behind vLLM's router
(`appo_trl.vllm.router`) a tree stays on one replica. Failures (retries, aborts, a restarted server raising
`VLLMServerRestarted`) are told in docs/architecture.md ("vLLM"). With the adapter-only sync a request names the
LoRA version of its round (`adapters.request_model()`) instead of the served model. With a `PolicyClock` (in-flight
weight updates, docs/streaming.md) requests stream and every token keeps its policy version. Everything but
sampling (health, the served length) goes through its `ServerClient`. It does not start servers or sync weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json as jsonlib
import math
import ssl
import time
import uuid
from typing import Any

import httpx

from appo_trl.sampling import SamplingParams, Segment, add_version_run
from appo_trl.vllm.client import (
    ServerClient,
    VLLMAbortedError,
    VLLMRequestError,
    VLLMServerError,
    VLLMServerRestarted,
    server_message,
)
from appo_trl.vllm.inflight import PolicyClock

RETRY_STATUS = {408, 429, 500, 502, 503, 504}
SESSION_HEADER = "X-Session-ID"  # vllm-router's consistent_hash reads it first (then x-user-id, ...)


def _token_id(token: str) -> int:
    # with `return_tokens_as_token_ids`, vLLM spells every token as "token_id:<id>"
    return int(token.rsplit(":", 1)[1])


def segment_from_vllm(ids, logprobs, top, reason, stop_reason) -> Segment | None:
    """From vLLM's `finish_reason` / `stop_reason` (server and in-process alike); None for any other reason
    (e.g. `abort`), which each backend turns into its own error."""
    if reason == "length":
        return Segment(ids, logprobs, top, "length", None)
    if reason == "stop" and isinstance(stop_reason, str):
        return Segment(ids, logprobs, top, "stop", stop_reason)
    if reason == "stop":  # EOS (stop_reason None) or a stop token id
        return Segment(ids, logprobs, top, "eos", None)
    return None


def choice_tokens(
    choice: dict[str, Any], want_top: bool
) -> tuple[list[int], list[float], list[dict[int, float]] | None]:
    """The token ids, their logprobs and top logprobs (None unless `want_top`) of one `/v1/completions` choice of
    vLLM 0.31 (`return_token_ids=true`), whole or one streamed chunk."""
    ids = [int(t) for t in choice.get("token_ids") or []]
    lp = choice.get("logprobs") or {}
    raw = lp.get("token_logprobs") or []
    if len(raw) != len(ids):
        raise VLLMServerError(f"server returned {len(ids)} token ids but {len(raw)} logprobs")
    tokens = lp.get("tokens")
    if tokens is not None and [_token_id(t) for t in tokens] != ids:
        raise VLLMServerError("logprob tokens do not match the returned token ids")
    logprobs = [math.nan if v is None else float(v) for v in raw]
    top = None
    if want_top:
        top = []
        for i, entry in enumerate(lp.get("top_logprobs") or [None] * len(ids)):
            d = {_token_id(k): (math.nan if v is None else float(v)) for k, v in (entry or {}).items()}
            d.setdefault(ids[i], logprobs[i])
            top.append(d)
    return ids, logprobs, top


def parse_choice(choice: dict[str, Any], want_top: bool) -> Segment:
    """Build a `Segment` from one `/v1/completions` choice of vLLM 0.31 (`return_token_ids=true`)."""
    if "token_ids" not in choice:
        raise VLLMServerError(
            "the server's completion has no token_ids: it ignores return_token_ids (vLLM 0.31 has it)"
        )
    ids, logprobs, top = choice_tokens(choice, want_top)
    reason = choice.get("finish_reason")
    segment = segment_from_vllm(ids, logprobs, top, reason, choice.get("stop_reason"))
    if segment is not None:
        return segment
    if reason == "abort":  # a truncated completion, never a finished one
        raise VLLMAbortedError(f"the server aborted the request after {len(ids)} tokens (finish_reason 'abort')")
    raise VLLMServerError(f"unexpected finish_reason {reason!r} (a finished completion has 'stop' or 'length')")


@dataclasses.dataclass
class _Streamed:
    """The tokens of one streamed completion (or of several, stitched by `extend`)."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None
    version_runs: list[tuple[int, int]]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    chunks: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (tokens, text) per streamed chunk

    def extend(self, part: _Streamed) -> None:
        self.token_ids += part.token_ids
        self.logprobs += part.logprobs
        if self.top_logprobs is not None:
            self.top_logprobs += part.top_logprobs
        for version, n in part.version_runs:
            add_version_run(self.version_runs, version, n)
        self.chunks += part.chunks

    def drop_open_stop(self, stops: list[str]) -> int:
        """Drop the last chunks whose text may begin a stop string, and return how many tokens went. vLLM looks for
        stop strings in one request's own text, so a re-fed request would never see one that began before it."""
        text = "".join(t for _, t in self.chunks)
        open_chars = max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        dropped = dropped_chars = 0
        while dropped_chars < open_chars and self.chunks:
            n, piece = self.chunks.pop()
            dropped, dropped_chars = dropped + n, dropped_chars + len(piece)
        if dropped:
            keep = len(self.token_ids) - dropped
            del self.token_ids[keep:], self.logprobs[keep:]
            if self.top_logprobs is not None:
                del self.top_logprobs[keep:]
            runs, self.version_runs = self.version_runs, []
            for version, n in runs:
                add_version_run(
                    self.version_runs, version, max(0, min(n, keep - sum(m for _, m in self.version_runs)))
                )
        return dropped


class VLLMServerBackend:
    """Backend talking to vLLM's OpenAI-compatible server.

    Args:
        base_url: server root, e.g. `"http://127.0.0.1:8000"`.
        model: the served model id; looked up from `GET /v1/models` on first use when None.
        max_concurrency: requests in flight at once from this backend.
        timeout_s: per-request read timeout (a long generation must fit in it; the trainer's
            `vllm_request_timeout_s`).
        connect_timeout_s: connection timeout.
        max_retries: retries after the first attempt for connection errors, timeouts, 5xx/429 answers and
            requests the server aborted.
        backoff_s: first retry delay, doubled each retry.
        extra_body: extra request fields (e.g. `{"repetition_penalty": 1.05}`); they override the defaults.
        connections_per_client: keep-alive connections per underlying `httpx.AsyncClient` (requests are spread
            over `ceil(max_concurrency / connections_per_client)` clients).
        server_wait_s: how long a server that refuses connections is waited for (`GET /health`) before failing;
            0 (default) fails when the retries are spent. When it comes back, `VLLMServerRestarted` is raised.
        adapters: the adapter-only sync's `AdapterVersions`: each request names its `request_model()` (the LoRA
            version of the round in flight) instead of the served model; None: the served model.
        clock: the policy version of the weights in flight updates (`ServerPause`) advance: requests stream, each
            token is stamped with the version it arrived under (`Segment.version_runs`), and a request the server
            aborted is re-fed its prompt plus its partial tokens and stitched into one completion; each request
            carries the version's `cache_salt`, so none reuses prefix-cache blocks of older weights. None: one
            answer per request, an aborted request is sent again whole.
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        max_concurrency: int = 512,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        extra_body: dict[str, Any] | None = None,
        connections_per_client: int = 32,
        server_wait_s: float = 0.0,
        adapters=None,
        clock: PolicyClock | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.extra_body = dict(extra_body or {})
        self.connections_per_client = connections_per_client
        self.server_wait_s = server_wait_s
        self.adapters = adapters
        self.clock = clock
        # the prefix cache is keyed per policy version: a request after an in-flight update never reuses blocks
        # computed by the old weights (a keep-mode pause cannot reset the cache: its requests hold blocks)
        self.salt = f"appo-{uuid.uuid4().hex[:8]}"
        self.server = ServerClient(self.base_url, timeout_s, connect_timeout_s=connect_timeout_s,
                                   max_retries=max_retries, backoff_s=backoff_s)  # fmt: skip
        self._clients: dict[int, tuple[list[httpx.AsyncClient], asyncio.Semaphore]] = {}
        self._next = 0
        self._ssl: ssl.SSLContext | None = None
        self.num_requests = 0
        self.num_retries = 0
        self.num_aborts = 0

    def _client(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        # One set of clients per event loop (an AsyncClient must not be shared across loops). httpcore's pool
        # scans every connection on every request event, so hundreds of connections in one pool cost
        # O(connections^2); requests are spread round-robin over clients of `connections_per_client` each.
        key = id(asyncio.get_running_loop())
        if key not in self._clients:
            per = max(1, min(self.connections_per_client, self.max_concurrency))
            limits = httpx.Limits(max_connections=per, max_keepalive_connections=per)
            n = -(-self.max_concurrency // per)
            if self._ssl is None:  # building an SSL context costs ~25 ms: share one
                self._ssl = ssl.create_default_context()
            clients = [
                httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout, limits=limits, verify=self._ssl)
                for _ in range(n)
            ]
            self._clients[key] = (clients, asyncio.Semaphore(self.max_concurrency))
        clients, sem = self._clients[key]
        self._next = (self._next + 1) % len(clients)
        return clients[self._next], sem

    async def _request(self, method: str, path: str, json: dict | None = None, headers: dict | None = None,
                       read=None) -> Any:  # fmt: skip
        """The JSON answer, or with `read` (an async function of the response) a streamed answer it reads; either
        retried whole on connection errors, timeouts and 5xx/429 answers."""
        client, sem = self._client()
        last: str = ""
        refused = False  # a connection was refused: the server stopped, maybe restarted
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.num_retries += 1
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with sem:
                    if read is None:
                        resp = await client.request(method, path, json=json, headers=headers)
                    else:
                        async with client.stream(method, path, json=json, headers=headers) as resp:
                            if resp.status_code != 200:
                                await resp.aread()  # the error's message
                            elif not (refused and self.server_wait_s > 0):  # else: a new server, told below
                                return await read(resp)
            except httpx.TimeoutException as exc:
                if isinstance(exc, httpx.ConnectTimeout):
                    last = f"timed out connecting ({type(exc).__name__})"
                else:  # accepted, then silent: a hung or overloaded server, or a long generation
                    last = f"timed out: no answer within vllm_request_timeout_s={self.timeout_s:g} s ({type(exc).__name__})"
                continue
            except httpx.TransportError as exc:
                last = f"unreachable ({type(exc).__name__}: {exc})"
                refused = refused or isinstance(exc, httpx.ConnectError)
                continue
            if refused and self.server_wait_s > 0:  # answered by a new server process: not with our weights
                raise VLLMServerRestarted(f"vLLM server {self.base_url} refused connections ({last}) and is back")
            if resp.status_code in RETRY_STATUS:
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            if resp.status_code != 200:
                message = server_message(resp)
                raise VLLMRequestError(
                    f"vLLM server {self.base_url}{path} answered HTTP {resp.status_code}: {message}",
                    resp.status_code,
                    message,
                )
            return resp.json()
        if refused and self.server_wait_s > 0:
            await self._wait_for_restart(path, last)
        raise VLLMServerError(
            f"vLLM server at {self.base_url}{path} failed after {self.max_retries + 1} attempts: {last}. "
            "Is `vllm serve` running there (see the README for the command)?"
        )

    async def _wait_for_restart(self, path: str, last: str) -> None:
        """Poll `GET /health` for up to `server_wait_s`; raise `VLLMServerRestarted` when it answers 200."""
        start = time.monotonic()
        while time.monotonic() - start < self.server_wait_s:
            if await asyncio.to_thread(self.server.probe) is None:
                raise VLLMServerRestarted(
                    f"vLLM server {self.base_url} refused connections ({last}) and is back after "
                    f"{time.monotonic() - start:.1f} s"
                )
            await asyncio.sleep(min(1.0, self.server_wait_s / 10))
        raise VLLMServerError(
            f"vLLM server at {self.base_url}{path} is unreachable ({last}) and did not come back within "
            f"vllm_server_wait_s={self.server_wait_s:g} s (GET /health). Is `vllm serve` running there?"
        )

    async def model_id(self) -> str:
        if self.model is None:
            data = await self._request("GET", "/v1/models")
            self.model = data["data"][0]["id"]
        return self.model

    def resolve_max_model_len(self, configured: int | None) -> int:
        """The served `max_model_len`, checked against `configured` (`ServerClient.resolve_max_model_len`; blocking:
        call it at start-up, outside the event loop). Sets `model` to the served one when it was None."""
        self.model, served = self.server.resolve_max_model_len(configured, self.model)
        return served

    def request_body(self, prompt_ids: list[int], params: SamplingParams, model: str) -> dict[str, Any]:
        """The exact JSON body sent for one `generate` call."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": [list(prompt_ids)],
            "n": 1,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "logprobs": params.logprobs,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = int(params.seed) % (2**63)
        body.update(self.extra_body)
        return body

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Segment:
        if self.clock is not None:
            return await self._generate_streamed(prompt_ids, params)
        start = time.perf_counter()
        adapter = self.adapters.request_model() if self.adapters is not None else None
        body = self.request_body(prompt_ids, params, adapter or await self.model_id())
        headers = {SESSION_HEADER: params.session_id} if params.session_id else None
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.num_retries += 1
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            self.num_requests += 1
            data = await self._request("POST", "/v1/completions", body, headers)
            choices = data.get("choices") or []
            if len(choices) != 1:
                raise VLLMServerError(f"expected 1 choice from {self.base_url}, got {len(choices)}")
            try:
                seg = parse_choice(choices[0], want_top=params.logprobs > 0)
            except VLLMAbortedError as exc:  # same prompt and seed again; the partial tokens are dropped
                self.num_aborts += 1
                last = exc
                continue
            seg.latency_s = time.perf_counter() - start
            return seg
        raise VLLMAbortedError(
            f"vLLM server {self.base_url} aborted the request {self.max_retries + 1} times ({last}); "
            "is it paused (POST /resume) or shutting down?"
        )

    async def _read_stream(self, resp: httpx.Response, want_top: bool) -> _Streamed:
        """One streamed completion (server-sent events), each chunk's tokens stamped with the clock's version when
        it arrives; with `clock.per_request` (abort and wait pauses: no request runs across an update) every token
        with the version at its first token, so a stream running behind the engine is never split."""
        out = _Streamed([], [], [] if want_top else None, [])
        first: int | None = None
        ended = False  # `data: [DONE]` came
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            if (payload := line[5:].strip()) == "[DONE]":
                ended = True
                continue
            chunk = jsonlib.loads(payload)
            if chunk.get("error"):
                error = chunk["error"]
                message = error.get("message") if isinstance(error, dict) else error
                raise VLLMServerError(f"vLLM server {self.base_url} failed a streamed completion: {message}")
            for choice in chunk.get("choices") or []:
                ids, logprobs, top = choice_tokens(choice, want_top)
                if first is None and ids:
                    first = self.clock.version
                version = first if self.clock.per_request and first is not None else self.clock.version
                add_version_run(out.version_runs, version, len(ids))
                out.token_ids += ids
                out.logprobs += logprobs
                if out.top_logprobs is not None:
                    out.top_logprobs += top
                out.chunks.append((len(ids), choice.get("text") or ""))
                if choice.get("finish_reason") is not None:
                    out.finish_reason, out.stop_reason = choice["finish_reason"], choice.get("stop_reason")
                self.clock.touch(len(ids))
        if out.finish_reason is None and ended and not out.token_ids:
            # vLLM's completion stream drops a request's chunks while it has no token yet (chunked prefill), the
            # abort chunk too: a request aborted by a pause before its first token ends with `[DONE]` alone
            out.finish_reason = "abort"
        if out.finish_reason is None:
            raise VLLMServerError(
                f"vLLM server {self.base_url} ended a streamed completion without a finish_reason after "
                f"{len(out.token_ids)} tokens ({'with' if ended else 'without'} data: [DONE])"
            )
        return out

    async def _generate_streamed(self, prompt_ids: list[int], params: SamplingParams) -> Segment:
        """`generate` under in-flight updates: streamed, every token's version kept, an abort re-fed and stitched."""
        start = time.perf_counter()
        headers = {SESSION_HEADER: params.session_id} if params.session_id else None
        want_top = params.logprobs > 0
        done = _Streamed([], [], [] if want_top else None, [])
        idle = 0  # aborts in a row that brought no new token
        while True:
            # a re-feed continues the completion: its prompt ends with the partial tokens, its seed moves on (the
            # random draws of the tokens sampled so far are not used again)
            n = len(done.token_ids)
            sub = dataclasses.replace(params, max_tokens=params.max_tokens - n,
                                      seed=None if params.seed is None else params.seed + n)  # fmt: skip
            while self.clock.held:  # aborted by a pause: re-fed once the servers run the new weights
                await asyncio.sleep(0.01)
            adapter = self.adapters.request_model() if self.adapters is not None else None  # a re-feed asks again
            model = adapter or await self.model_id()
            body = {**self.request_body(list(prompt_ids) + done.token_ids, sub, model), "stream": True,
                    "cache_salt": f"{self.salt}-v{self.clock.version}"}  # fmt: skip
            self.num_requests += 1
            part = await self._request("POST", "/v1/completions", body, headers,
                                       read=lambda resp: self._read_stream(resp, want_top))  # fmt: skip
            done.extend(part)
            if part.finish_reason != "abort":
                seg = segment_from_vllm(done.token_ids, done.logprobs, done.top_logprobs, part.finish_reason,
                                        part.stop_reason)  # fmt: skip
                if seg is None:
                    raise VLLMServerError(f"unexpected finish_reason {part.finish_reason!r} (a finished completion "
                                          "has 'stop' or 'length')")  # fmt: skip
                return dataclasses.replace(seg, latency_s=time.perf_counter() - start, version_runs=done.version_runs)
            self.num_aborts += 1
            idle = 0 if part.token_ids else idle + 1
            done.drop_open_stop(params.stop)
            if idle > self.max_retries:
                raise VLLMAbortedError(
                    f"vLLM server {self.base_url} aborted the request {idle} times in a row without a new token; "
                    "is it paused (POST /resume) or shutting down?"
                )

    async def health(self) -> bool:
        """True when `GET /health` answers 200 (no retries)."""
        return await asyncio.to_thread(self.server.probe) is None

    async def aclose(self) -> None:
        key = id(asyncio.get_running_loop())
        entry = self._clients.pop(key, None)
        if entry is not None:
            for client in entry[0]:
                await client.aclose()


__all__ = ["VLLMAbortedError", "VLLMRequestError", "VLLMServerBackend", "VLLMServerError", "VLLMServerRestarted",
           "parse_choice", "segment_from_vllm"]  # fmt: skip
