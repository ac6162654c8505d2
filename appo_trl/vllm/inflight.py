"""In-flight weight updates: freeze the servers' running requests, update the weights, resume them.

vLLM 0.31 serves `POST /pause?mode=keep|abort|wait`, `POST /resume` and `GET /is_paused` when started with
`VLLM_SERVER_DEV_MODE=1` (`vllm/entrypoints/serve/dev/rlhf/api_router.py` in its wheel). `keep` freezes every
running request (no decode step runs until `/resume`), with its KV cache when `clear_cache=false` (vLLM's
default, true, preempts them: their cache is recomputed at `/resume`; `ServerPause` sends false);
`abort` ends them with `finish_reason: "abort"` and their partial tokens (`VLLMServerBackend` re-feeds those
under the new weights); `wait` lets them finish first. In every mode new requests queue until `/resume`.

`ServerPause.paused(version)` pauses every server it is given (each replica directly: the router has no such
route), yields for the update, then advances the sampler's `PolicyClock` to `version` and resumes. It always
resumes: after an exception, Ctrl-C, or a SIGTERM in the main thread (the servers are resumed first, then the
signal takes its course; a server it could not resume is named in a note the stage's stop line carries). Its
faults end in one `InFlightUpdateError` line: a pause that times out (the server is watched for a pause it takes
late), a `/resume` that fails, a replica that died while paused. `pause_capability(urls)` tells at start-up whether
every server has the routes (one line if not: the weights then sync between rounds). The rules: docs/streaming.md.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator

import httpx

from appo_trl.vllm.client import VLLMServerError, server_message

logger = logging.getLogger(__name__)


class PauseMode(str, enum.Enum):
    """What `/pause` does with the running requests (vLLM's `PauseMode`)."""

    KEEP = "keep"  # frozen with their KV cache; they continue after /resume
    ABORT = "abort"  # ended with their partial tokens (finish_reason "abort"); the sampler re-feeds them
    WAIT = "wait"  # finished first, under the old weights


class InFlightUpdateError(VLLMServerError):
    """An in-flight update could not pause or resume a server (timed out, failed, or the server died)."""


class PolicyClock:
    """The policy version a server sampler stamps on each token it receives (`Segment.version_runs`).

    `ServerPause` advances it while the servers are paused, once the update is done: a token received before
    is of the old version, one received after of the new one. `touch` (the sampler, per streamed chunk) keeps the
    time of the last token received, so the pause can wait until the tokens sampled before it have arrived.
    `held` is true from just before the servers pause until they have resumed: a request aborted by the pause is
    re-fed only after it (under the new version and its prefix-cache salt).
    """

    def __init__(self, version: int = 0):
        self._version = int(version)
        self._lock = threading.Lock()
        self.last_token_at = 0.0
        self.tokens_received = 0
        self.held = False
        self.per_request = False  # set by an abort or wait `ServerPause`: a request's tokens are of one version

    @property
    def version(self) -> int:
        return self._version

    def advance(self, version: int) -> None:
        with self._lock:
            if version <= self._version:
                raise ValueError(f"policy version {version} is not after the current one, {self._version}")
            self._version = int(version)

    def touch(self, n_tokens: int) -> None:
        """`n_tokens` arrived now (one streamed chunk)."""
        self.last_token_at = time.monotonic()
        self.tokens_received += n_tokens

    def settle(self, quiet_s: float, most_s: float) -> bool:
        """Wait until no token has arrived for `quiet_s` seconds; False if tokens still arrive after `most_s`."""
        deadline = time.monotonic() + most_s
        while (wait := self.last_token_at + quiet_s - time.monotonic()) > 0:
            if time.monotonic() > deadline:
                return False
            time.sleep(min(wait, quiet_s))
        return True


def pause_capability(urls: list[str], timeout_s: float = 10.0) -> bool:
    """True when every server answers `GET /is_paused`; else one warning line (the weights sync between rounds)."""
    missing = []
    for url in urls:
        try:
            resp = httpx.get(f"{url}/is_paused", timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise InFlightUpdateError(
                f"vLLM server {url} unreachable at GET /is_paused: {type(exc).__name__}: {exc}"
            ) from exc
        if resp.status_code != 200 or not isinstance(_json(resp).get("is_paused"), bool):
            missing.append(url)
    if missing:
        logger.warning("vLLM server %s has no /pause (it needs vLLM 0.31 started with VLLM_SERVER_DEV_MODE=1): no "
                       "in-flight updates, the weights sync between rounds", ", ".join(missing))  # fmt: skip
    return not missing


def _gone(url: str) -> bool:
    """True when the server at `url` refuses a fresh connection (its process is gone)."""
    try:
        httpx.get(f"{url}/health", timeout=5.0)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def _json(resp: httpx.Response) -> dict:
    try:
        data = resp.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


class _SignalGuard:
    """Within: SIGTERM raises `KeyboardInterrupt` in the main thread (so the `finally` that resumes runs). After
    `hold()` a signal is only recorded (a resume in progress is not cut short); on exit the previous handlers come
    back and a recorded SIGTERM is delivered to them (the default one ends the process, as it would have)."""

    def __init__(self):
        self.active = threading.current_thread() is threading.main_thread()
        self.raising = True
        self.got: list[int] = []
        self.previous: dict[int, object] = {}

    def _handler(self, signum, frame):
        self.got.append(signum)
        if self.raising:
            self.raising = False
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} during an in-flight weight update")

    def __enter__(self):
        if self.active:
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self.previous[sig] = signal.signal(sig, self._handler)
        return self

    def hold(self) -> None:
        self.raising = False

    def __exit__(self, exc_type, exc, tb) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if signal.SIGTERM in self.got and signal.SIGTERM in self.previous:
            handler = self.previous[signal.SIGTERM]
            if callable(handler):
                try:
                    handler(signal.SIGTERM, None)
                except BaseException as raised:  # the stage's own stop (its exit line): keep the resume's notes
                    for note in getattr(exc, "__notes__", ()):
                        raised.add_note(note)
                    raise
            elif handler is signal.SIG_DFL:
                signal.raise_signal(signal.SIGTERM)
        if signal.SIGINT in self.got and exc_type is None:  # a Ctrl-C while the servers were being resumed
            raise KeyboardInterrupt("SIGINT during an in-flight weight update")


class ServerPause:
    """Pause every server for an in-flight weight update, and always resume them (see the module docstring).

    Args:
        urls: every vLLM server: the one server, or each replica behind the router (never the router).
        mode: `PauseMode` (or its value): what the running requests do during the update.
        clock: the sampler's `PolicyClock`, advanced to the new version before the servers resume.
        timeout_s: most seconds one `/pause` may take (`wait` mode: until the running requests finish); after one
            that timed out, the resumed server is watched as long again, so a pause it takes late is undone.
        resume_attempts: `/resume` calls per server before it is reported still paused.
        backoff_s: delay between two `/resume` attempts.
        settle_s: quiet time (no token arriving) waited for before the clock advances, so every token sampled
            before the pause is stamped with the old version.
        clear_cache: `/pause`'s `clear_cache`. vLLM 0.31 honours it in every mode: true preempts the running
            requests and resets the prefix cache, so a kept request recomputes its KV cache under the new weights
            at `/resume`. Default false in every mode: in `keep` mode the old weights' KV cache stays (as in
            PipelineRL), and the sampler's per-version cache salt keeps every later request off old blocks; on the
            loaded test machine a pause with true landed only after 1,500-token requests had finished.
    """

    def __init__(self, urls: list[str], *, mode: PauseMode | str = PauseMode.KEEP, clock: PolicyClock | None = None,
                 timeout_s: float = 60.0, resume_attempts: int = 3, backoff_s: float = 0.5, settle_s: float = 0.05,
                 clear_cache: bool = False):  # fmt: skip
        if not urls:
            raise ValueError("ServerPause needs at least one server URL")
        try:
            self.mode = PauseMode(mode)
        except ValueError:
            raise ValueError(f"pause mode {mode!r}: expected one of {[m.value for m in PauseMode]}") from None
        self.clear_cache = bool(clear_cache)
        self.urls = [u.rstrip("/") for u in urls]
        if clock is not None:
            clock.per_request = self.mode is not PauseMode.KEEP
        self.clock, self.timeout_s, self.settle_s = clock, timeout_s, settle_s
        self.resume_attempts, self.backoff_s = max(1, resume_attempts), backoff_s
        self.num_pauses = 0
        self.pause_s_last = 0.0  # seconds the servers were paused at the last update (pause to resumed)

    def _pause(self, http: httpx.Client, url: str) -> None:
        what = f"POST {url}/pause?mode={self.mode.value}"
        try:
            params = {"mode": self.mode.value, "clear_cache": str(self.clear_cache).lower()}
            resp = http.post(f"{url}/pause", params=params)
        except httpx.TimeoutException as exc:
            self._late.add(url)  # the server may still pause after it: watched once resumed
            raise InFlightUpdateError(f"vLLM server {url} did not pause within {self.timeout_s:g} s ({what})") from exc
        except httpx.HTTPError as exc:
            raise InFlightUpdateError(f"vLLM server {url} unreachable at {what}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code == 404:
            raise InFlightUpdateError(
                f"vLLM server {url} has no /pause: start it with VLLM_SERVER_DEV_MODE=1 (vLLM 0.31)"
            )
        if resp.status_code != 200:
            raise InFlightUpdateError(
                f"vLLM server {url} answered HTTP {resp.status_code} to {what}: {server_message(resp)}"
            )

    def _resume(self, http: httpx.Client, url: str) -> str | None:
        """Resume `url`; None when it is running again, else the reason it is not."""
        last, transport = "", False
        for attempt in range(self.resume_attempts):
            if attempt:
                time.sleep(self.backoff_s)
            try:
                resp = http.post(f"{url}/resume")
                if resp.status_code == 200:
                    check = http.get(f"{url}/is_paused")
                    if _json(check).get("is_paused") is False:
                        return None
                    last = f"GET /is_paused answered {check.status_code} {check.text[:200]!r} after POST /resume"
                else:
                    last = f"POST /resume answered HTTP {resp.status_code}: {server_message(resp)}"
            except httpx.HTTPError as exc:
                last, transport = f"{type(exc).__name__}: {exc}", isinstance(exc, httpx.TransportError)
        if transport and _gone(url):
            return f"vLLM server {url} died while paused ({last}): its running requests are lost"
        return (f"vLLM server {url} is still paused: {last} ({self.resume_attempts} attempts); it samples nothing "
                f"until `curl -X POST {url}/resume`")  # fmt: skip

    def _watch_late_pause(self, http: httpx.Client, url: str) -> str | None:
        """After a `/pause` that timed out and the resume: the server may still take that pause (a handler that
        outlived its client), and freeze after the resume. Watch `GET /is_paused` for `timeout_s` more and resume
        again if it does; None when it runs at the end, else the reason it does not."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            time.sleep(min(0.05, self.timeout_s))
            try:
                paused = _json(http.get(f"{url}/is_paused")).get("is_paused")
            except httpx.HTTPError:
                continue
            if paused is True:
                logger.warning("vLLM server %s took the /pause that had timed out after it was resumed: resuming it "
                               "again", url)  # fmt: skip
                return self._resume(http, url)
        return None

    @contextlib.contextmanager
    def paused(self, version: int | None = None) -> Iterator[ServerPause]:
        """Pause every server, yield for the update, advance the clock to `version` (when given) and resume."""
        touched: list[str] = []  # asked to pause (also the one whose pause failed: it may have paused anyway)
        self._late: set[str] = set()  # whose /pause timed out
        start = time.monotonic()
        with _SignalGuard() as guard, httpx.Client(timeout=self.timeout_s) as http:  # one client per update
            try:
                if self.clock is not None:
                    self.clock.held = True
                for url in self.urls:
                    touched.append(url)
                    self._pause(http, url)
                self.num_pauses += 1
                yield self
                if self.clock is not None and version is not None:
                    # keep mode stamps tokens as they arrive: the streams must have caught up with the engine
                    if not self.clock.per_request and not self.clock.settle(
                        self.settle_s, most_s=self.timeout_s
                    ):  # a stream far behind is waited for
                        raise InFlightUpdateError(
                            f"tokens still arrive {self.timeout_s:g} s into the pause of {', '.join(self.urls)}: a "
                            "server that decodes while paused, so the tokens' policy versions cannot be told"
                        )
                    self.clock.advance(version)
            finally:
                guard.hold()
                problems = []
                for url in touched:
                    problem = self._resume(http, url)
                    if problem is None and url in self._late:
                        problem = self._watch_late_pause(http, url)
                    if problem is not None:
                        problems.append(problem)
                if self.clock is not None:
                    self.clock.held = False
                self.pause_s_last = time.monotonic() - start
                if problems:
                    line = "; ".join(problems)
                    failed = sys.exc_info()[1]
                    if failed is None:
                        raise InFlightUpdateError(line)
                    if not isinstance(failed, Exception):  # Ctrl-C / SIGTERM: it goes on; its exit line tells
                        logger.error("%s", line)
                        failed.add_note(line)  # `run_interruptible`'s stop line carries it
                    else:
                        raise InFlightUpdateError(f"{line} (after the update failed: {type(failed).__name__}: "
                                                  f"{failed})") from failed  # fmt: skip


__all__ = ["InFlightUpdateError", "PauseMode", "PolicyClock", "ServerPause", "pause_capability"]
