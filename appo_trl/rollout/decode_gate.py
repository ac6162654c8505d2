"""`DecodeGate`: the in-process sampler's in-flight weight update, between two decode steps.

`TransformersBackend` decodes token by token; with a gate, each step's forward runs inside `gate.step()`, which
yields the policy version its tokens are sampled under (the `clock`'s, read as the step starts). The trainer's
`gate.paused()` waits for the step in progress to end, holds the next one while the weights of the sampler's
model are replaced (and the clock advanced), and lets decoding go on: the in-process counterpart of vLLM's
`/pause?mode=keep` ... `/resume` (docs/streaming.md). What the running sequences do after it is the gate's `mode`:

- `keep`: they continue over the KV cache the old weights computed for their prefix (nothing recomputed);
- `abort`: their KV cache is dropped and the whole prefix recomputed under the new weights at the next step, as a
  re-fed request is on vLLM (`recompute_since(swaps)` tells the decode loop).

Tool calls and everything else on the event loop are not paused: only decoding waits.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Protocol

GATE_MODES = ("keep", "abort")


class VersionClock(Protocol):
    """What the gate reads: the policy version of the weights the sampler holds (`appo_trl.vllm.PolicyClock`)."""

    @property
    def version(self) -> int: ...


class DecodeGate:
    """Decode steps and the weight swaps between them (module docstring).

    Args:
        clock: the sampler's policy clock (its `version` stamps each step's tokens).
        mode: `keep` or `abort` (`inflight_update`).
    """

    def __init__(self, clock: VersionClock, mode: str = "keep"):
        if mode not in GATE_MODES:
            raise ValueError(f"in-process inflight_update must be one of {GATE_MODES}, got {mode!r}")
        self.clock, self.mode = clock, mode
        self._cv = threading.Condition()
        self._active = 0  # decode steps running
        self._paused = False
        self.swaps = 0  # weight swaps so far (`abort`: a step after a swap recomputes the prefix)
        self.steps = 0  # decode steps started so far
        self.pause_s_last = 0.0

    @contextlib.contextmanager
    def step(self) -> Iterator[int]:
        """One decode step (its forward and sampling); yields the version its tokens are sampled under."""
        with self._cv:
            while self._paused:
                self._cv.wait()
            self._active += 1
            self.steps += 1
            version = self.clock.version
        try:
            yield version
        finally:
            with self._cv:
                self._active -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within: no decode step runs (the one in progress has ended); swap the weights and advance the clock
        here. Decoding goes on at exit, whatever happened inside."""
        start = time.monotonic()
        with self._cv:
            if self._paused:
                raise RuntimeError("DecodeGate.paused is not reentrant")
            self._paused = True
            while self._active:
                self._cv.wait()
        try:
            yield
        finally:
            with self._cv:
                self._paused = False
                self.swaps += 1
                self._cv.notify_all()
            self.pause_s_last = time.monotonic() - start

    def recompute_since(self, swaps: int) -> bool:
        """True when a sequence last stepped at swap count `swaps` must recompute its prefix (`abort` only)."""
        return self.mode == "abort" and self.swaps != swaps


__all__ = ["GATE_MODES", "DecodeGate", "VersionClock"]
