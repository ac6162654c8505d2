"""The trainer's in-flight weight sync: TRL's weight sync run inside `ServerPause` (appo_trl/vllm/inflight.py).

`InFlightSync.sync(version)` pauses every server (each replica, never the router), pushes the weights by the disk
route (`DiskWeightSync`) without its prefix-cache reset (inside a `keep` pause the frozen requests hold blocks; the
sampler's per-version cache salt keeps later requests off the old weights' blocks), or by the adapter route with
every version loaded in place under one name (`AdapterVersions.in_place`: a running request keeps naming it),
advances the sampler's clock to `version` and resumes; in `abort` mode the sampler re-feeds the aborted requests
under the new weights. Its faults are `ServerPause`'s one-line `InFlightUpdateError`s. The NCCL route is refused
at start-up in one line. `InProcessSync` is the same for the in-process sampler copy: its weights are swapped
between two decode steps (`appo_trl.rollout.decode_gate.DecodeGate`). The rules: docs/streaming.md.
"""

from __future__ import annotations

import logging

from appo_trl.rollout.decode_gate import DecodeGate
from appo_trl.vllm.inflight import PauseMode, PolicyClock, ServerPause

logger = logging.getLogger(__name__)


class InFlightSync:
    """Weight syncs inside a pause of every server (module docstring).

    Args:
        generation: TRL's `vllm_generation` (appo's `DiskWeightSync`: full weights, or the adapter only).
        urls: every vLLM server (`ServerSpec.urls`: the replicas behind a router).
        mode: `PauseMode` (or its value), `inflight_update`.
        clock: the sampler's `PolicyClock` (the `VLLMServerBackend` stamps tokens with it).
        timeout_s: most seconds one `/pause` may take.
    """

    def __init__(self, generation, urls: list[str], mode: PauseMode | str, clock: PolicyClock,
                 timeout_s: float = 60.0):  # fmt: skip
        if not hasattr(generation, "reset_prefix_cache"):
            raise ValueError(
                f"rollout_stream with the {type(generation).__name__} weight sync (NCCL): an in-flight update needs "
                "the disk route (vllm_weight_sync: disk), whose prefix-cache reset can be left out inside a pause"
            )
        if getattr(generation, "adapter", False):
            generation.adapters.in_place = True  # one name, loaded in place: what a running request names
        self.generation, self.clock = generation, clock
        self.pause = ServerPause(urls, mode=mode, clock=clock, timeout_s=timeout_s)
        self.pause_s: list[float] = []  # seconds the servers were paused, per sync

    @property
    def version(self) -> int:
        return self.clock.version

    def sync(self, version: int) -> float:
        """Push the trainer's weights as `version` with every server paused; the seconds they were paused."""
        gen = self.generation
        before, gen.reset_prefix_cache = gen.reset_prefix_cache, False
        try:
            with self.pause.paused(version=version):
                gen.sync_weights()
        finally:
            gen.reset_prefix_cache = before
            self.pause_s.append(self.pause.pause_s_last)
        return self.pause.pause_s_last



class InProcessSync:
    """In-flight updates of the in-process sampler copy (module docstring): `sync(version)` waits for the decode
    step in progress, copies the policy's weights into the copy, advances the clock and lets decoding go on.

    Args:
        sampler: the sampler copy (`SamplerCopy`: its `model` decodes, `sync(policy)` loads the policy's weights).
        policy: returns the policy module whose weights are copied (the unwrapped trainer model).
        gate: the copy's backend's `DecodeGate` (its mode is `inflight_update`).
        clock: the `PolicyClock` the gate stamps tokens with.
    """

    def __init__(self, sampler, policy, gate: DecodeGate, clock: PolicyClock):
        self.sampler, self.policy, self.gate, self.clock = sampler, policy, gate, clock
        self.pause_s: list[float] = []  # seconds decoding was held, per sync

    @property
    def version(self) -> int:
        return self.clock.version

    def sync(self, version: int) -> float:
        """The policy's weights into the sampler copy as `version`, between two decode steps; the seconds held."""
        try:
            with self.gate.paused():
                self.sampler.sync(self.policy())
                self.clock.advance(version)
        finally:
            self.pause_s.append(self.gate.pause_s_last)
        return self.gate.pause_s_last


__all__ = ["InFlightSync", "InProcessSync"]
