"""`VLLMColocateBackend`: sampling from an in-process `vllm.LLM` (TRL's `vllm_mode: colocate` engine).

The same contract as `VLLMServerBackend` (token ids in, the exact sampled ids and their logprobs out, one request
per `generate`) on `trainer.vllm_generation.llm`: one worker thread owns the engine, adds every queued request
(`add_request`) and `step()`s while any is unfinished, so requests join and leave the running batch as they come;
a failure inside the engine fails every request in flight and every later one (nothing waits forever). One engine
per rank, without tensor parallelism (docs/architecture.md, "vLLM"). It does not build the `LLM` or sync weights
(TRL's `VLLMGeneration`, `appo_trl.vllm.weight_sync.ColocateWeightSync`); `awake()` wraps a round in sleep mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import queue
import threading
import time
from typing import Any

from appo_trl.sampling import SamplingParams, Segment
from appo_trl.vllm.server import segment_from_vllm


class VLLMColocateError(RuntimeError):
    """The in-process vLLM engine failed (the original error is the `__cause__`)."""


def parse_output(output: Any, want_top: bool) -> Segment:
    """A `Segment` from one finished `vllm.RequestOutput` (`n=1`)."""
    [choice] = output.outputs
    ids = [int(t) for t in choice.token_ids]
    entries = choice.logprobs or []
    if len(entries) != len(ids):
        raise VLLMColocateError(f"vLLM returned {len(ids)} token ids but {len(entries)} logprob entries")
    logprobs, top = [], [] if want_top else None
    for tok, entry in zip(ids, entries):
        if tok not in entry:
            raise VLLMColocateError(f"vLLM's logprobs do not include the sampled token {tok}")
        value = entry[tok].logprob
        logprobs.append(math.nan if value is None else float(value))
        if want_top:
            top.append({int(k): float(v.logprob) for k, v in entry.items()})
    segment = segment_from_vllm(ids, logprobs, top, choice.finish_reason, choice.stop_reason)
    if segment is not None:
        return segment
    reason = choice.finish_reason
    raise VLLMColocateError(f"vLLM ended a request with finish_reason {reason!r} after {len(ids)} tokens")


class VLLMColocateBackend:
    """Backend on an in-process `vllm.LLM` (TRL's colocated engine).

    Args:
        llm: the engine, e.g. `trainer.vllm_generation.llm`.
        extra_sampling: extra `vllm.SamplingParams` fields (e.g. `{"repetition_penalty": 1.05}`); they override
            the defaults.
        sleep_mode: the engine was built with `enable_sleep_mode=True` (TRL's `vllm_enable_sleep_mode`): `awake()`
            wakes its KV cache for a round and puts it back to sleep (level 2) after.
    """

    def __init__(self, llm, *, extra_sampling: dict[str, Any] | None = None, sleep_mode: bool = False):
        self.llm = llm
        self.extra_sampling = dict(extra_sampling or {})
        self.sleep_mode = sleep_mode
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._failure: BaseException | None = None
        self.num_requests = 0
        self.cached_tokens = 0  # prompt tokens served from vLLM's prefix cache, over all requests

    # ---- the contract ------------------------------------------------------------------------------------------
    def sampling_params(self, params: SamplingParams):
        """The exact `vllm.SamplingParams` of one `generate` call."""
        from vllm import SamplingParams as VSamplingParams

        kwargs: dict[str, Any] = dict(
            n=1, max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k, logprobs=params.logprobs, skip_special_tokens=False,
            include_stop_str_in_output=True, stop=list(params.stop) or None,
            seed=None if params.seed is None else int(params.seed) % (2**63),
        )  # fmt: skip
        kwargs.update(self.extra_sampling)
        return VSamplingParams(**kwargs)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Segment:
        start = time.perf_counter()
        vparams = self.sampling_params(params)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._submit((f"appo-{next(self._ids)}", list(prompt_ids), vparams, params.logprobs > 0, loop, future))
        seg = await future
        seg.latency_s = time.perf_counter() - start
        return seg

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker thread (requests still queued fail); the `LLM` itself stays (TRL owns it)."""
        with self._lock:
            self._closed, thread = True, self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=60)
        with self._lock:
            self._thread = None
            self._closed = False

    @contextlib.contextmanager
    def awake(self):
        """Around one round: wake the KV cache (sleep mode), and put the engine back to sleep (level 2) after."""
        if not self.sleep_mode:
            yield
            return
        self.llm.wake_up(tags=["kv_cache"])
        try:
            yield
        finally:
            self.llm.sleep(level=2)

    # ---- the worker --------------------------------------------------------------------------------------------
    def _submit(self, item) -> None:
        with self._lock:
            if self._failure is not None:
                raise VLLMColocateError(
                    f"the in-process vLLM engine failed earlier: {self._failure}"
                ) from self._failure
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="appo-vllm-colocate", daemon=True)
                self._thread.start()
            self.num_requests += 1
        self._inbox.put(item)
        self._wake.set()

    @staticmethod
    def _resolve(loop, future, result=None, error: BaseException | None = None) -> None:
        def set_it():
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits any more
            loop.call_soon_threadsafe(set_it)

    def _run(self) -> None:
        engine = self.llm.llm_engine
        pending: dict[str, tuple] = {}
        try:
            while True:
                while True:  # every queued request joins the running batch
                    try:
                        rid, ids, vparams, want_top, loop, future = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    try:
                        engine.add_request(rid, {"prompt_token_ids": ids}, vparams)
                    except Exception as exc:  # noqa: BLE001 - a bad request (too long, ...) fails alone
                        self._resolve(loop, future, error=VLLMColocateError(f"vLLM rejected a request: {exc}"))
                        continue
                    pending[rid] = (want_top, loop, future)
                if self._closed:
                    break
                if not pending:
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                for out in engine.step():
                    if not out.finished or out.request_id not in pending:
                        continue
                    want_top, loop, future = pending.pop(out.request_id)
                    self.cached_tokens += int(getattr(out, "num_cached_tokens", 0) or 0)
                    try:
                        self._resolve(loop, future, parse_output(out, want_top))
                    except VLLMColocateError as exc:
                        self._resolve(loop, future, error=exc)
        except BaseException as exc:  # noqa: BLE001 - surfaced to every caller, never a hang
            with self._lock:
                self._failure = exc
            error = VLLMColocateError(f"the in-process vLLM engine failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            for _, loop, future in pending.values():
                self._resolve(loop, future, error=error)
            pending.clear()
        finally:
            if pending:  # closed with requests in flight
                for rid in pending:
                    with contextlib.suppress(Exception):
                        engine.abort_request([rid])
                closed = VLLMColocateError("the colocate backend was closed with requests in flight")
                for _, loop, future in pending.values():
                    self._resolve(loop, future, error=closed)
            while True:  # requests that arrived after the end
                try:
                    *_, loop, future = self._inbox.get_nowait()
                except queue.Empty:
                    break
                self._resolve(loop, future, error=self._failure or VLLMColocateError("the backend was closed"))


__all__ = ["VLLMColocateBackend", "VLLMColocateError", "parse_output"]
