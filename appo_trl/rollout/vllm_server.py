"""`VLLMServerBackend`: sampling from a running `vllm serve` over HTTP (`POST /v1/completions`).

Each `generate` call is one request with a single token-id prompt (`"prompt": [ids]`), `n=1`, its own seed,
`return_token_ids` for the exact sampled ids, `logprobs` for the sampled token's logprob (plus top-k when
asked), and the tool stop strings with `include_stop_str_in_output`. A request with `SamplingParams.session_id`
carries it as the `X-Session-ID` header: behind vLLM's router (`appo_trl.rollout.router`) every request of
one tree then lands on one replica. Many requests are in flight at once over
one `httpx.AsyncClient` (vLLM batches them continuously).

The server's failure modes, as a real vLLM 0.31 shows them:

- connection errors, timeouts, 408/429 and 5xx are retried with backoff; when the retries are spent a
  `VLLMServerError` names the URL and the last error;
- a server that refused connections (it stopped or restarts) is waited for when `server_wait_s > 0`: `GET
  /health` is polled until it answers 200, for up to `server_wait_s` seconds. A server that comes back (or
  answers a retry after refusing a connection) is a new process with the weights it loaded at start, so
  `VLLMServerRestarted` is raised instead of sampling from it: the trainer syncs the weights again and re-runs
  the round (`appo_trl.trainer.weight_sync.generate_round`);
- every other 4xx (prompt + max_tokens over `--max-model-len`, logprobs over `--max-logprobs`, an unknown
  model name) raises `VLLMRequestError` at once, with the server's own message;
- a request the server aborts (`POST /pause`, shutdown, preemption) answers HTTP 200 with
  `finish_reason: "abort"` and a partial completion. That is never an EOS: the request is sent again from the
  same prompt (the partial tokens are dropped), up to `max_retries` times, then `VLLMAbortedError` is raised;
- `resolve_max_model_len` reads `max_model_len` from `GET /v1/models`, and refuses a configured length that
  differs from the served one.

What this module does not do: start the server or sync weights (the trainer does that once per round through
TRL's NCCL engine on GPU, or `appo_trl.trainer.weight_sync` on a CPU server). Start the server with TRL's flags,
e.g.::

    VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen3-8B --weight-transfer-config '{"backend":"nccl"}' \\
        --logprobs-mode processed_logprobs --max-logprobs -1 --enable-prefix-caching
"""

from __future__ import annotations

import asyncio
import math
import ssl
import time
from typing import Any

import httpx

from appo_trl.rollout.types import SamplingParams, Segment

RETRY_STATUS = {408, 429, 500, 502, 503, 504}
SESSION_HEADER = "X-Session-ID"  # vllm-router's consistent_hash reads it first (then x-user-id, ...)


class VLLMServerError(RuntimeError):
    """The vLLM server could not serve a request (unreachable, timing out, or answering errors)."""


class VLLMRequestError(VLLMServerError):
    """The server rejected a request with a 4xx answer (not retried); `status` and the server's `message`."""

    def __init__(self, text: str, status: int, message: str):
        super().__init__(text)
        self.status, self.message = status, message


class VLLMServerRestarted(VLLMServerError):
    """The server refused connections and is back: a new process, whose weights must be synced before sampling."""


class VLLMAbortedError(VLLMServerError):
    """The server aborted a request (`finish_reason: "abort"`): paused, shutting down or preempted."""


def server_message(resp: httpx.Response) -> str:
    """The error message of a vLLM answer (`{"error": {"message": ...}}`, `{"message": ...}` or `{"detail": ...}`)."""
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:1000]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if data.get(key):
                return str(data[key])
    return resp.text[:1000]


def _token_id(token: str) -> int:
    # with `return_tokens_as_token_ids`, vLLM spells every token as "token_id:<id>"
    return int(token.rsplit(":", 1)[1])


def parse_choice(choice: dict[str, Any], want_top: bool) -> Segment:
    """Build a `Segment` from one `/v1/completions` choice of vLLM 0.31 (`return_token_ids=true`)."""
    ids = [int(t) for t in choice["token_ids"]]
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
    reason = choice.get("finish_reason")
    segment = Segment.from_vllm(ids, logprobs, top, reason, choice.get("stop_reason"))
    if segment is not None:
        return segment
    if reason == "abort":  # a truncated completion, never a finished one
        raise VLLMAbortedError(f"the server aborted the request after {len(ids)} tokens (finish_reason 'abort')")
    raise VLLMServerError(f"unexpected finish_reason {reason!r} (a finished completion has 'stop' or 'length')")


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

    async def _request(self, method: str, path: str, json: dict | None = None, headers: dict | None = None) -> dict:
        client, sem = self._client()
        last: str = ""
        refused = False  # a connection was refused: the server stopped, maybe restarted
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.num_retries += 1
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with sem:
                    resp = await client.request(method, path, json=json, headers=headers)
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
            await self._wait_for_restart(client, path, last)
        raise VLLMServerError(
            f"vLLM server at {self.base_url}{path} failed after {self.max_retries + 1} attempts: {last}. "
            "Is `vllm serve` running there (see the README for the command)?"
        )

    async def _wait_for_restart(self, client: httpx.AsyncClient, path: str, last: str) -> None:
        """Poll `GET /health` for up to `server_wait_s`; raise `VLLMServerRestarted` when it answers 200."""
        start = time.monotonic()
        while time.monotonic() - start < self.server_wait_s:
            try:
                if (await client.get("/health")).status_code == 200:
                    raise VLLMServerRestarted(
                        f"vLLM server {self.base_url} refused connections ({last}) and is back after "
                        f"{time.monotonic() - start:.1f} s"
                    )
            except httpx.HTTPError:
                pass
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
        """The served `max_model_len` (from `GET /v1/models`), checked against `configured` when given.

        Blocking (call it at start-up, outside the event loop). Raises `ValueError` naming both numbers when
        they differ, and `VLLMServerError` when the server does not report it or serves another model.
        """
        url = f"{self.base_url}/v1/models"
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                resp = httpx.get(url, timeout=self.timeout)
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if resp.status_code != 200:
                raise VLLMServerError(f"vLLM server {url} answered HTTP {resp.status_code}: {server_message(resp)}")
            break
        else:
            raise VLLMServerError(f"vLLM server at {url} is unreachable ({last}). Is `vllm serve` running there?")
        models = resp.json().get("data") or []
        if not models:
            raise VLLMServerError(f"vLLM server {url} serves no model")
        if self.model is None:
            self.model = models[0]["id"]
        entry = next((m for m in models if m.get("id") == self.model), None)
        if entry is None:
            served = ", ".join(str(m.get("id")) for m in models)
            raise VLLMServerError(
                f"vLLM server {self.base_url} does not serve model {self.model!r} (it serves {served})"
            )
        served_len = entry.get("max_model_len")
        if served_len is None:
            if configured is None:
                raise VLLMServerError(f"vLLM server {url} does not report max_model_len; set vllm_max_model_length")
            return int(configured)
        if configured is not None and int(configured) != int(served_len):
            raise ValueError(
                f"vllm_max_model_length={configured} but the vLLM server at {self.base_url} serves "
                f"max_model_len={served_len}: set them equal (or leave vllm_max_model_length unset to use the server's)."
            )
        return int(served_len)

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
        start = time.perf_counter()
        body = self.request_body(prompt_ids, params, await self.model_id())
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

    async def health(self) -> bool:
        """True when `GET /health` answers 200 (no retries)."""
        client, _ = self._client()
        try:
            return (await client.get("/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def aclose(self) -> None:
        key = id(asyncio.get_running_loop())
        entry = self._clients.pop(key, None)
        if entry is not None:
            for client in entry[0]:
                await client.aclose()
