"""The `search` tool: one query in, ARPO-formatted snippets out, from a pluggable backend behind a persistent cache.

Backends (`backend:` in the tool config; `SEARCH_BACKENDS` registry):

- `local`: a retriever server speaking the Search-R1 protocol (`POST /retrieve {"queries", "topk",
  "return_scores"}` -> `{"result": [[{"document": {...}, "score": s}, ...], ...]}`), e.g. `appo serve-search`.
  Concurrent calls are coalesced into one batched request.
- `web`: Bright Data's SERP API over Bing, as ARPO used it. The API key and zone come **only** from environment
  variables (`BRIGHTDATA_API_KEY`, `BRIGHTDATA_ZONE`; names configurable); requests are rate limited, and
  retried with exponential backoff on transient failures only (timeouts, connection errors, 429 and 5xx).
- `cache`: replay only: answers from the cache (ARPO's JSON file or our SQLite file) and reports a miss as a
  clear "not in cache" result. Together with `appo serve-search` this makes search-based training fully offline.

Results are formatted as ARPO does: non-empty snippets de-duplicated, the first `max_results` kept, each cut to
`result_length` characters, joined as `Page i: snippet` lines; "No search results found." when empty. Double quotes
are removed from the query. Successful results are stored in the cache (`cache_path`, SQLite; `seed_path` imports
ARPO's JSON cache); errors never are. Secrets never appear in results or logs (error texts are scrubbed).

Cache entries are keyed by the query *and* what produced the result: `max_results`, `result_length` and the
backend's identity. For `local` that is the corpus fingerprint the server reports on `/health` (appo-trl's
`appo serve-search`; with `check_server: false`, any Search-R1 server, identified by its URL); for `web`, the
market and location. The identity is resolved before the cache is consulted, so a server that is down, or
that is not a search server (vLLM on port 8000), gets an error result, never a stale cached one. Entries
imported with `seed_path` answer any backend with the same parameters (the user vouches for them); the
`cache` backend (replay) answers from any backend's entries with the same parameters, and from entries
stored without parameters (caches written before they were keyed). There is
no default cache file: `appo train` and `appo eval` put one in the run's output folder unless `cache_path`
is set (so runs do not share one file in the home directory by accident).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import urllib.parse
from typing import Any, Protocol

import httpx

from appo_trl.tools.base import ToolResult, sanitize_text
from appo_trl.tools.search_cache import JsonReplayCache, SearchCache
from appo_trl.tools.search_server import DEFAULT_PORT, SERVICE_NAME

logger = logging.getLogger(__name__)

NO_RESULTS = "No search results found."
DEFAULT_SEARCH_URL = f"http://127.0.0.1:{DEFAULT_PORT}/retrieve"
SEED_IDENTITY = "seed"


@dataclasses.dataclass
class SearchToolConfig:
    """Parameters of the `search` tool (`tool_config: {search: {...}}` in a recipe).

    Args:
        backend: `local`, `web` or `cache` (see the module docstring).
        url: the `local` backend's retrieve endpoint.
        max_results: snippets shown to the model (ARPO: 10).
        result_length: characters kept per snippet (ARPO: 1000).
        timeout_s: per-request timeout.
        retries: extra attempts after a transient failure (not for 4xx errors or malformed replies).
        backoff_s: first retry delay; doubles each attempt.
        check_server: `local`: require `/health` to identify appo-trl's search server (`appo serve-search`);
            false accepts any Search-R1 `/retrieve` server, identified in the cache by its URL.
        cache: put the persistent cache in front of the backend.
        cache_path: SQLite cache file; for `backend: cache` it may also be ARPO's JSON file (read-only). None:
            no persistent cache (`appo train` / `appo eval` default it to `<output_dir>/search_cache.sqlite`).
        seed_path: ARPO JSON cache imported into the SQLite cache at start-up (existing entries win).
        cache_namespace: key prefix in the SQLite cache; give backends with different outputs different ones.
        rate_limit_per_s: `web` requests per second (token bucket).
        api_key_env, zone_env: names of the environment variables holding the `web` credentials.
        market: Bing `mkt` for non-CJK queries (CJK queries use zh-CN, as ARPO did); `location` is Bing's `cc`.
    """

    backend: str = "local"
    url: str = DEFAULT_SEARCH_URL
    max_results: int = 10
    result_length: int = 1000
    timeout_s: float = 30.0
    retries: int = 3
    backoff_s: float = 1.0
    check_server: bool = True
    cache: bool = True
    cache_path: str | None = None
    seed_path: str | None = None
    rate_limit_per_s: float = 32.0
    api_key_env: str = "BRIGHTDATA_API_KEY"
    zone_env: str = "BRIGHTDATA_ZONE"
    cache_namespace: str = "search"
    market: str = "en-US"
    location: str = "us"

    def __post_init__(self):
        if self.backend not in SEARCH_BACKENDS:
            import difflib

            close = difflib.get_close_matches(str(self.backend), SEARCH_BACKENDS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            valid = ", ".join(sorted(SEARCH_BACKENDS))
            raise ValueError(f"search.backend={self.backend!r} is unknown; valid: {valid}.{hint}")
        for name in ("max_results", "result_length", "timeout_s", "rate_limit_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"search.{name} must be > 0, got {getattr(self, name)}")
        if self.retries < 0:
            raise ValueError(f"search.retries must be >= 0, got {self.retries}")
        if self.backend == "cache" and not self.cache_path:
            raise ValueError("search.backend='cache' needs search.cache_path (ARPO JSON or SQLite cache file)")


def format_results(snippets: list[str], max_results: int = 10, result_length: int = 1000) -> str:
    """ARPO's format: unique non-empty snippets, first `max_results`, each cut to `result_length`, `Page i: ...`."""
    seen: list[str] = []
    for snippet in snippets:
        snippet = (snippet or "").strip()
        if snippet and snippet not in seen:
            seen.append(snippet)
        if len(seen) == max_results:
            break
    if not seen:
        return NO_RESULTS
    return "\n".join(f"Page {i}: {s[:result_length]}" for i, s in enumerate(seen, 1))


class BackendError(Exception):
    """A backend failure; `transient` ones are retried."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class SearchBackend(Protocol):
    name: str

    async def search(self, query: str) -> list[str]:
        """Snippets for one query, best first; raises BackendError."""

    async def aclose(self) -> None: ...


class _LoopClients:
    """One `httpx.AsyncClient` per event loop: a client's connections belong to the loop that opened them, and
    callers (evaluation, the CLI) may run the same tool under successive `asyncio.run` calls."""

    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs
        self.clients: dict[int, tuple[asyncio.AbstractEventLoop, httpx.AsyncClient]] = {}

    def get(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        entry = self.clients.get(id(loop))
        if entry is None or entry[0] is not loop:
            entry = self.clients[id(loop)] = (loop, httpx.AsyncClient(**self.kwargs))
        return entry[1]

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        for key, (owner, client) in list(self.clients.items()):
            if owner is loop:
                await client.aclose()
            del self.clients[key]


def _document_text(doc: Any) -> str:
    """Search-R1 documents carry `contents` ('"Title"\\ntext'); other corpora `title` + `text`."""
    if isinstance(doc, str):
        return doc
    if not isinstance(doc, dict):
        return str(doc)
    if doc.get("contents"):
        return str(doc["contents"]).replace("\n", " ")
    title, text = str(doc.get("title") or ""), str(doc.get("text") or "")
    return f"{title}: {text}" if title and text else title or text


class LocalRetrieverBackend:
    """Client of a Search-R1 `/retrieve` server; concurrent queries are sent as one batch."""

    name = "local"

    def __init__(self, config: SearchToolConfig):
        self.config = config
        self._clients = _LoopClients(timeout=config.timeout_s, trust_env=False)
        self._queue: list[tuple[str, asyncio.Future]] = []
        self._flush_scheduled = False  # a flusher that has not taken the queue yet

    async def search(self, query: str) -> list[str]:
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((query, fut))
        if not self._flush_scheduled:  # (a flusher already posting its batch does not see this query)
            self._flush_scheduled = True
            asyncio.ensure_future(self._flush())
        return await fut

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let the other calls of this event-loop tick join the batch
        self._flush_scheduled = False
        batch, self._queue = self._queue, []
        try:
            results = await self._post([q for q, _ in batch])
        except BaseException as exc:  # noqa: BLE001 - delivered to every waiter
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception) else BackendError(repr(exc)))
            return
        for (_, fut), docs in zip(batch, results):
            if not fut.done():
                fut.set_result(docs)

    @property
    def health_url(self) -> str:
        base = self.config.url.rstrip("/")
        return (base[: -len("/retrieve")] if base.endswith("/retrieve") else base) + "/health"

    def _identity_from(self, status: int | None, body: Any) -> str:
        """`appo-search:<corpus sha256>` for our server; the URL when checks are off; else BackendError."""
        if isinstance(body, dict) and body.get("service") == SERVICE_NAME and body.get("corpus_fingerprint"):
            return f"appo-search:{body['corpus_fingerprint']}"
        if not self.config.check_server:
            return f"url:{self.config.url}"
        seen = "no JSON" if body is None else f"{str(body)[:80]!r}"
        raise BackendError(
            f"{self.health_url} is not an appo-trl search server (HTTP {status}, {seen}); start one with "
            "`appo serve-search --corpus FILE.jsonl`, fix search.url, or set search.check_server: false "
            "for another Search-R1 /retrieve server"
        )

    @staticmethod
    def _json(resp: httpx.Response) -> Any:
        try:
            return resp.json()
        except ValueError:
            return None

    async def identity(self) -> str:
        """The backend identity for cache keys, from `GET /health`; raises BackendError (transient if down)."""
        try:
            resp = await self._clients.get().get(self.health_url)
        except httpx.TransportError as exc:
            if not self.config.check_server:
                return f"url:{self.config.url}"
            raise BackendError(f"retriever unreachable at {self.health_url} ({type(exc).__name__})", True) from None
        return self._identity_from(resp.status_code, self._json(resp))

    def check(self) -> str:
        """Synchronous start-up check (`appo_trl.configs.preflight`): the server answers and is ours; returns its identity."""
        try:
            resp = httpx.get(self.health_url, timeout=min(self.config.timeout_s, 10.0), trust_env=False)
        except httpx.TransportError as exc:
            raise BackendError(
                f"no search server at {self.health_url} ({type(exc).__name__}); start it with "
                "`appo serve-search --corpus FILE.jsonl` or fix search.url"
            ) from None
        return self._identity_from(resp.status_code, self._json(resp))

    async def _post(self, queries: list[str]) -> list[list[str]]:
        body = {"queries": queries, "topk": self.config.max_results, "return_scores": True}
        try:
            resp = await self._clients.get().post(self.config.url, json=body)
        except httpx.TimeoutException:
            raise BackendError(f"retriever timed out after {self.config.timeout_s:g}s", transient=True) from None
        except httpx.TransportError as exc:
            raise BackendError(f"retriever unreachable at {self.config.url} ({type(exc).__name__})", True) from None
        if resp.status_code != 200:
            raise BackendError(f"retriever HTTP {resp.status_code}", transient=resp.status_code >= 500)
        try:
            result = resp.json()["result"]
            if not isinstance(result, list) or len(result) != len(queries):
                raise ValueError("result length mismatch")
            return [[_document_text(item.get("document", item) if isinstance(item, dict) else item)
                     for item in row] for row in result]  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BackendError(f"malformed retriever reply ({exc})") from None

    async def aclose(self) -> None:
        await self._clients.aclose()


class _RateLimiter:
    """Token bucket without a lock: each caller reserves the next free slot (`rate` per second, bursts of up to
    `rate`) synchronously, then sleeps until it; safe on any event loop, FIFO among callers."""

    def __init__(self, rate: float):
        self.rate = rate
        self.next_slot = 0.0

    async def acquire(self) -> None:
        now = time.monotonic()
        slot = max(self.next_slot, now - (self.rate - 1) / self.rate)
        self.next_slot = slot + 1 / self.rate
        if slot > now:
            await asyncio.sleep(slot - now)


class WebSearchBackend:
    """Bright Data SERP API over Bing (ARPO's online search); credentials from the environment only."""

    name = "web"
    endpoint = "https://api.brightdata.com/request"

    def __init__(self, config: SearchToolConfig, client: httpx.AsyncClient | None = None):
        self.config = config
        self._key = os.environ.get(config.api_key_env, "")
        self._zone = os.environ.get(config.zone_env, "")
        missing = [name for name, v in ((config.api_key_env, self._key), (config.zone_env, self._zone)) if not v]
        if missing:
            raise ValueError(f"search.backend='web' needs the environment variable(s) {', '.join(missing)}")
        self._client = client  # injected (tests); otherwise one client per event loop
        self._clients = _LoopClients(timeout=config.timeout_s)
        self._limiter = _RateLimiter(config.rate_limit_per_s)

    def __repr__(self) -> str:  # never show the key
        return f"WebSearchBackend(zone_env={self.config.zone_env!r}, api_key_env={self.config.api_key_env!r})"

    def request_body(self, query: str) -> dict[str, str]:
        cjk = any("\u4e00" <= ch <= "\u9fff" for ch in query)
        mkt, lang = ("zh-CN", "zh") if cjk else (self.config.market, self.config.market.split("-")[0])
        params = urllib.parse.urlencode(
            {"q": query, "mkt": mkt, "setLang": lang, "brd_json": 1, "cc": self.config.location}
        )
        return {"zone": self._zone, "url": f"https://www.bing.com/search?{params}", "format": "raw"}

    async def search(self, query: str) -> list[str]:
        await self._limiter.acquire()
        headers = {"Authorization": f"Bearer {self._key}", "Content-Type": "application/json"}
        try:
            client = self._client or self._clients.get()
            resp = await client.post(self.endpoint, json=self.request_body(query), headers=headers)
        except httpx.TimeoutException:
            raise BackendError(f"web search timed out after {self.config.timeout_s:g}s", transient=True) from None
        except httpx.TransportError as exc:
            raise BackendError(f"web search connection failed ({type(exc).__name__})", transient=True) from None
        if resp.status_code != 200:
            transient = resp.status_code == 429 or resp.status_code >= 500
            raise BackendError(f"web search HTTP {resp.status_code}", transient=transient)
        try:
            organic = resp.json().get("organic") or []
            return [str(item.get("description") or "") for item in organic if isinstance(item, dict)]
        except (ValueError, AttributeError) as exc:
            raise BackendError(f"malformed web search reply ({type(exc).__name__})") from None

    def scrub(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    async def identity(self) -> str:
        return f"web:bing:{self.config.market}:{self.config.location}"

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
        await self._clients.aclose()


class CacheOnlyBackend:
    """Replay-only: every query is a cache miss by the time it reaches a backend."""

    name = "cache"

    def __init__(self, config: SearchToolConfig):
        self.config = config

    async def search(self, query: str) -> list[str]:
        raise BackendError("not in cache")

    async def aclose(self) -> None:
        pass


SEARCH_BACKENDS: dict[str, type] = {
    "local": LocalRetrieverBackend,
    "web": WebSearchBackend,
    "cache": CacheOnlyBackend,
}


class SearchTool:
    """The `search` tool: `<search>query</search>` -> `Page 1: ...` lines (see the module docstring)."""

    name = "search"
    tag = "search"

    def __init__(self, config: SearchToolConfig | None = None, **kwargs: Any):
        self.config = config or SearchToolConfig(**kwargs)
        cfg = self.config
        self.backend = SEARCH_BACKENDS[cfg.backend](cfg)
        self._identity: str | None = None  # resolved on first use (`/health` for local)
        self._identity_task: asyncio.Task | None = None
        self.cache: SearchCache | JsonReplayCache | None = None
        if cfg.backend == "cache" and str(cfg.cache_path).endswith(".json"):
            self.cache = JsonReplayCache(cfg.cache_path)
        elif cfg.cache and cfg.cache_path:
            self.cache = SearchCache(cfg.cache_path, namespace=cfg.cache_namespace)
        if cfg.seed_path:
            if not isinstance(self.cache, SearchCache):
                raise ValueError("search.seed_path needs a SQLite cache_path (and cache: true)")
            self.cache.seed_from_json(cfg.seed_path, scope=self._scope(), source=SEED_IDENTITY)

    def _scope(self) -> str:
        """Cache scope: the parameters that shape a formatted result (the source is the backend identity)."""
        return f"k={self.config.max_results};len={self.config.result_length}"

    def check(self) -> None:
        """Start-up check: the backend is reachable and is what the config says (raises ValueError)."""
        checker = getattr(self.backend, "check", None)
        if checker is not None:
            try:
                self._identity = checker()
            except BackendError as exc:
                raise ValueError(self._scrub(str(exc))) from None

    async def _resolve_identity(self) -> str:
        """The backend identity, asked once for all concurrent calls of this event loop (they then resume
        together, so their queries still go out as one batch); a failure is retried by the next call."""
        if self._identity is not None:
            return self._identity
        loop = asyncio.get_running_loop()
        pending = self._identity_task
        if (
            pending is None
            or pending.get_loop() is not loop
            or (pending.done() and (pending.cancelled() or pending.exception()))
        ):
            pending = self._identity_task = loop.create_task(self.backend.identity())
        identity = await asyncio.shield(pending)
        self._identity = identity
        return identity

    def _cached(self, query: str, identity: str | None) -> str | None:
        if self.cache is None:
            return None
        if isinstance(self.cache, JsonReplayCache):
            return self.cache.get(query)
        scope = self._scope()
        if identity is None:  # replay only: any backend's entry with these parameters (or a pre-scope entry)
            return self.cache.get_any(query, scope) or self.cache.get(query)
        return self.cache.get(query, scope, identity) or self.cache.get(query, scope, SEED_IDENTITY)

    def _scrub(self, text: str) -> str:
        return self.backend.scrub(text) if hasattr(self.backend, "scrub") else text

    async def call(self, text: str) -> ToolResult:
        start = time.perf_counter()
        query = text.replace('"', "").strip()
        if not query:
            return ToolResult("Error: empty search query.", ok=False, error="empty_input")
        identity = None
        if self.config.backend != "cache":  # who answers decides which cache entries apply
            try:
                identity = await self._resolve_identity()
            except BackendError as exc:
                return ToolResult(self._scrub(f"Search failed: {exc}"), False, time.perf_counter() - start,
                                  error="backend_error", meta={"cache_hit": False})  # fmt: skip
        hit = self._cached(query, identity)
        if hit is not None:
            return ToolResult(hit, True, time.perf_counter() - start, meta={"cache_hit": True})
        if self.config.backend == "cache":
            message = f"Not in cache: no stored search result for {query!r} (offline cache-only search)."
            return ToolResult(message, False, time.perf_counter() - start, error="not_in_cache",
                              meta={"cache_hit": False})  # fmt: skip
        cfg = self.config
        attempt, delay = 0, cfg.backoff_s
        while True:
            try:
                snippets = await self.backend.search(query)
                break
            except BackendError as exc:
                if exc.transient and attempt < cfg.retries:
                    attempt += 1
                    reason = self._scrub(str(exc))
                    logger.info("search: transient failure (%s), retry %d/%d", reason, attempt, cfg.retries)
                    await asyncio.sleep(delay)
                    delay *= 2
                    continue
                if exc.transient:  # the server may come back with another corpus: ask /health again
                    self._identity = self._identity_task = None
                message = self._scrub(f"Search failed: {exc}")
                return ToolResult(message, False, time.perf_counter() - start, error="backend_error",
                                  meta={"cache_hit": False, "attempts": attempt + 1})  # fmt: skip
        result = sanitize_text(format_results(snippets, cfg.max_results, cfg.result_length))
        if self.cache is not None and isinstance(self.cache, SearchCache) and result != NO_RESULTS:
            await asyncio.to_thread(self.cache.put, query, result, self._scope(), identity)
        count = 0 if result == NO_RESULTS else result.count("\nPage ") + 1
        meta = {"cache_hit": False, "attempts": attempt + 1, "results": count}
        return ToolResult(result, True, time.perf_counter() - start, meta=meta)

    async def aclose(self) -> None:
        await self.backend.aclose()
        if self.cache is not None:
            self.cache.close()
