"""`InFlightSync` (appo_trl/trainer/inflight_sync.py) against the scripted pausable server: the sync runs inside
the pause without the prefix-cache reset, a request in flight continues under the new version, a failed sync
resumes the server and keeps the old version, and routes that cannot update in flight are refused."""

from __future__ import annotations

import pytest

from appo_trl.sampling import SamplingParams
from appo_trl.trainer.inflight_sync import InFlightSync
from appo_trl.vllm.client import ServerClient
from appo_trl.vllm.inflight import PolicyClock
from appo_trl.vllm.server import VLLMServerBackend
from tests.rollout.pausable_vllm import Background, PausableVLLM

pytestmark = pytest.mark.network


class DiskLike:
    """`DiskWeightSync`'s surface: `sync_weights` reloads the server, then resets its prefix cache unless told not."""

    def __init__(self, url: str, fail: bool = False):
        self.url, self.fail, self.reset_prefix_cache, self.seen = url, fail, True, []

    def sync_weights(self):
        self.seen.append(self.reset_prefix_cache)
        if self.fail:
            raise OSError("No space left on device")
        ServerClient(self.url).reload_weights("/new")
        if self.reset_prefix_cache:
            raise AssertionError("the prefix cache was reset inside a keep pause")


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_request_in_flight_continues_under_the_new_version(mode):
    server = PausableVLLM().start()
    try:
        clock = PolicyClock(0)
        gen = DiskLike(server.url)
        sync = InFlightSync(gen, [server.url], mode, clock)
        request = Background(VLLMServerBackend(server.url, clock=clock), [5, 6, 7], SamplingParams(max_tokens=60))
        request.wait_tokens(clock, 10)
        sync.sync(1)
        seg = request.result()
        (v0, before), (v1, after) = seg.version_runs
        assert (v0, v1) == (0, 1) and before >= 10 and before + after == 60
        assert seg.logprobs[:before] == [-0.1] * before and seg.logprobs[before:] == [-0.2] * after
        assert gen.seen == [False] and gen.reset_prefix_cache is True  # left out inside the pause only
        assert len(sync.pause_s) == 1 and sync.pause_s[0] > 0 and server.calls[-1] == "resume"
    finally:
        server.stop()


def test_a_failed_sync_resumes_the_server_and_keeps_the_old_version():
    server = PausableVLLM().start()
    try:
        clock = PolicyClock(4)
        sync = InFlightSync(DiskLike(server.url, fail=True), [server.url], "keep", clock)
        with pytest.raises(OSError, match="No space left"):
            sync.sync(5)
        assert clock.version == 4 and server.calls[-1] == "resume" and server.state == "running"
    finally:
        server.stop()


def test_nccl_is_refused_and_the_adapter_route_loads_in_place():
    from appo_trl.vllm.lora import AdapterVersions

    class NCCL:
        def sync_weights(self): ...

    with pytest.raises(ValueError, match="weight sync \\(NCCL\\): an in-flight update needs the disk route"):
        InFlightSync(NCCL(), ["http://127.0.0.1:1"], "keep", PolicyClock())
    adapter = DiskLike("http://127.0.0.1:1")
    adapter.adapter, adapter.adapters = True, AdapterVersions({}, "/unused")
    InFlightSync(adapter, ["http://127.0.0.1:1"], "keep", PolicyClock())
    assert adapter.adapters.in_place  # every version under one name, which a running request keeps naming
