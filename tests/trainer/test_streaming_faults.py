"""Faults of `rollout_stream: true` at the trainer, against the scripted pausable server (bench/pausable_vllm.py):
a pause that times out, a replica that dies while paused (two replicas behind vLLM's router), Ctrl-C and SIGTERM
during a pause (through `run_interruptible`, the stage's stop line). Each ends in one line, and leaves no paused
server, none of the run's own threads and no port of the run bound. A `/resume` that fails:
test_streaming_trainer.py; a resume from a checkpoint with groups in flight: test_streaming_resume.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from appo_trl.stages.interrupts import run_interruptible
from appo_trl.vllm.inflight import InFlightUpdateError
from bench.pausable_vllm import PausableVLLM
from tests.trainer.test_streaming_trainer import STREAM
from tests.trainer.test_trainer import RewardSpy, make_trainer

pytestmark = pytest.mark.network
OWN = ("appo-",)  # the run's own threads: appo-rollout-loop, appo-round-N, appo-replica-monitor, ...


def listening() -> set[int]:
    """The TCP ports this process listens on."""
    return {c.laddr.port for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN}


class Leftovers:
    """What a run leaves behind: threads it started (by name, of this test only) and ports it listens on."""

    def __init__(self):
        self.threads, self.ports = set(threading.enumerate()), listening()

    def check(self, servers=()) -> None:
        left = [t for t in set(threading.enumerate()) - self.threads if t.name.startswith(OWN)]
        for t in left:
            t.join(timeout=10)
        assert not [t.name for t in left if t.is_alive()]
        assert listening() - self.ports - {s.port for s in servers} == set()


def test_a_pause_that_times_out_ends_in_one_line_and_no_server_stays_paused(tmp_path, tiny_tokenizer,
                                                                            tiny_model_path):  # fmt: skip
    seen = Leftovers()
    server = PausableVLLM(step_s=0.01, pause_delay_s=0.8).start()  # every /pause lands 0.8 s late
    try:
        trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(), max_steps=2,
                               vllm_server_base_url=server.url, inflight_timeout_s=0.5, **STREAM)  # fmt: skip
        with pytest.raises(InFlightUpdateError) as info:
            trainer.train()
        assert str(info.value) == (f"vLLM server {server.url} did not pause within 0.5 s (POST {server.url}/pause"
                                   "?mode=keep)")  # fmt: skip
        time.sleep(1.0)  # the late pause has landed: it was undone
        assert server.state == "running" and server.calls == ["pause:keep", "resume", "resume"]
        assert trainer.rounds.stream.stream is None
    finally:
        server.stop()
    seen.check([server])


def test_a_replica_that_dies_while_paused_is_one_line_and_the_other_resumes(tmp_path, tiny_tokenizer,
                                                                            tiny_model_path):  # fmt: skip
    from appo_trl.vllm.router import RouterError, router_executable

    try:
        router_executable()
    except RouterError:
        pytest.skip("vllm-router is not installed (pip install '.[router]')")
    seen = Leftovers()
    a, b = PausableVLLM(step_s=0.01).start(), PausableVLLM(step_s=0.01).start()
    trainer = None
    try:
        trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(), max_steps=2,
                               vllm_server_base_url=f"{a.url},{b.url}", **STREAM)  # fmt: skip
        assert trainer.rounds.stream.sync.pause.urls == [a.url, b.url]  # the replicas, not the router
        gen = trainer.vllm_generation
        sync = gen.sync_weights

        def sync_then_die():
            sync()
            b.kill()  # the second replica's process is gone while it is paused

        gen.sync_weights = sync_then_die
        with pytest.raises(InFlightUpdateError, match=f"^vLLM server {b.url} died while paused \\(ConnectError"):
            trainer.train()
        assert a.state == "running" and a.calls[-2:] == ["pause:keep", "resume"]
        assert trainer.rounds.stream.stream is None
    finally:
        if trainer is not None:
            trainer.vllm_server.close()  # the router appo started (else stopped at exit)
        a.stop()
        b.stop()
    seen.check([a, b])


def _stop_during_the_pause(trainer, signum: int) -> None:
    gen = trainer.vllm_generation
    sync = gen.sync_weights

    def sync_then_signal():
        sync()
        os.kill(os.getpid(), signum)
        time.sleep(30)  # the signal's handler raises in here

    gen.sync_weights = sync_then_signal


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_during_a_pause_resumes_the_server_then_stops(tmp_path, tiny_tokenizer, tiny_model_path,
                                                                        capsys, signum):  # fmt: skip
    seen = Leftovers()
    server = PausableVLLM(step_s=0.01).start()
    try:
        trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(), max_steps=2,
                               vllm_server_base_url=server.url, **STREAM)  # fmt: skip
        _stop_during_the_pause(trainer, signum)
        assert run_interruptible("appo train", str(tmp_path), trainer.train) == 128 + signum
        assert server.state == "running" and server.calls == ["pause:keep", "resume"]
        assert trainer.rounds.stream.stream is None
    finally:
        server.stop()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"appo train: stopped by {signal.Signals(signum).name}; no checkpoint was saved")
    seen.check([server])


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_during_a_pause_whose_resume_fails_says_so_in_its_stop_line(tmp_path, tiny_tokenizer, tiny_model_path,
                                                                           capsys, signum):  # fmt: skip
    seen = Leftovers()
    server = PausableVLLM(step_s=0.01, resume_fails=99).start()
    try:
        trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(), max_steps=2,
                               vllm_server_base_url=server.url, **STREAM)  # fmt: skip
        trainer.rounds.stream.sync.pause.backoff_s = 0.01
        _stop_during_the_pause(trainer, signum)
        assert run_interruptible("appo train", str(tmp_path), trainer.train) == 128 + signum
        assert server.state == "keep"  # it could not be resumed: the stop line says so
    finally:
        server.stop()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    name = signal.Signals(signum).name
    assert line == (f"appo train: stopped by {name}; vLLM server {server.url} is still paused: POST /resume answered "
                    "HTTP 500: Failed to resume generation: injected (3 attempts); it samples nothing until `curl -X "
                    f"POST {server.url}/resume`; no checkpoint was saved in {tmp_path} yet.")  # fmt: skip
    seen.check([server])
