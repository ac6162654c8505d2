"""`Background`: one streamed `VLLMServerBackend.generate` in a thread (the in-flight update tests pause the server
from the test's thread meanwhile); the scripted server is `bench/pausable_vllm.py`'s `PausableVLLM`."""

from __future__ import annotations

import asyncio
import threading
import time

from appo_trl.sampling import SamplingParams, Segment
from appo_trl.vllm.inflight import PolicyClock
from appo_trl.vllm.server import VLLMServerBackend
from bench.pausable_vllm import PausableVLLM

__all__ = ["Background", "PausableVLLM"]


class Background:
    """`backend.generate(prompt, params)` on its own event loop in a thread; `wait_tokens`, then `result`."""

    def __init__(self, backend: VLLMServerBackend, prompt: list[int], params: SamplingParams):
        self.backend, self.segment, self.error = backend, None, None

        async def go():
            try:
                return await backend.generate(prompt, params)
            finally:
                await backend.aclose()

        def run():
            try:
                self.segment = asyncio.run(go())
            except BaseException as exc:  # told by `result`
                self.error = exc

        self.thread = threading.Thread(target=run, name="inflight-request", daemon=True)
        self.thread.start()

    def wait_tokens(self, clock: PolicyClock, n: int, timeout_s: float = 120.0) -> int:
        deadline = time.monotonic() + timeout_s
        while clock.tokens_received < n:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise AssertionError(
                    f"the request ended or stalled after {clock.tokens_received} tokens: {self.error}"
                )
            time.sleep(0.002)
        return clock.tokens_received

    def result(self, timeout_s: float = 120.0) -> Segment:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise AssertionError(f"the request did not finish within {timeout_s:g} s")
        if self.error is not None:
            raise self.error
        return self.segment
