"""SIGTERM (Slurm, Kubernetes) stops `appo train` like Ctrl-C: cleanup, one line, exit code 143 (issue 21).

A real `appo train` subprocess (the tiny APPO recipe with the python sandbox) gets SIGTERM once its first
checkpoint exists: it must exit 143 within seconds with one message naming the checkpoint kept, no traceback,
no process of its tree left (sandbox zygote, bwrap) and no sandbox cgroup left; then a resume continues.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from appo_trl.configs.recipes import REPO_ROOT
from appo_trl.trainer.checkpoints import last_complete_checkpoint


def _cgroup_dirs_of(pid: int) -> list[str]:
    """Sandbox cgroup directories named after `pid`, under this process's cgroups (v1 and v2)."""
    found = []
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else ["unified", ""]:
                folder = os.path.join("/sys/fs/cgroup", name, path.lstrip("/"))
                if os.path.isdir(folder):
                    found += [
                        os.path.join(folder, n) for n in os.listdir(folder) if n.startswith(f"appo-sandbox-{pid}-")
                    ]
    return found


# `appo train`, with the python sandbox started when the tool is built (a real run starts it at the first call,
# which the random tiny model never makes): the sandbox's bwrap and zygote are then running when SIGTERM comes
APPO_TRAIN_EAGER_SANDBOX = """
import sys
from appo_trl.tools import python_sandbox as ps
build = ps.PythonTool.__init__
def eager(self, *a, **k):
    build(self, *a, **k)
    self.start()
ps.PythonTool.__init__ = eager
from appo_trl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _train(out, model, *extra, stderr=subprocess.PIPE):
    cmd = [sys.executable, "-c", APPO_TRAIN_EAGER_SANDBOX, "train", "--config", str(REPO_ROOT / "recipes/tiny/appo.yaml"),
           "--model_name_or_path", model, "--output_dir", str(out), "--save_steps", "1",
           "--max_completion_length", "24", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True)


def _sandboxed(tree) -> bool:
    try:
        return any("bwrap" in " ".join(p.cmdline()) for p in tree)
    except psutil.NoSuchProcess:
        return False


def test_sigterm_stops_like_ctrl_c(tiny_model_path, tmp_path):
    out = tmp_path / "run"
    proc = _train(out, tiny_model_path, "--max_steps", "500")
    try:
        deadline, tree = time.monotonic() + 240, []
        while last_complete_checkpoint(str(out), log=False) is None or not _sandboxed(tree):
            if proc.poll() is not None:
                pytest.fail(f"appo train ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
            assert time.monotonic() < deadline, "no checkpoint and sandbox after 240 s"
            time.sleep(0.2)
            tree = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    stops = [line for line in err.splitlines() if "stopped by SIGTERM" in line]
    assert len(stops) == 1 and stops[0].startswith("appo train: stopped by SIGTERM; kept "), err[-3000:]
    kept = stops[0].split("kept ", 1)[1].split(" ", 1)[0]
    assert kept == last_complete_checkpoint(str(out), log=False)
    time.sleep(0.5)
    left = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.cmdline() for p in left]
    assert not _cgroup_dirs_of(proc.pid)
    assert not [n for n in os.listdir(out) if n.startswith("_tmp-checkpoint-")]  # a save cut short is removed
    step = int(kept.rsplit("-", 1)[1])
    resumed = _train(out, tiny_model_path, "--max_steps", str(step + 1), "--resume_from_checkpoint", "true")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert f"Resuming from {kept}" in err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_run_interruptible_one_line_and_exit_code(tmp_path, capsys, signum):
    """In-process: SIGTERM and Ctrl-C (SIGINT) take one path: `finally` blocks run, one line, 128 + signal."""
    from appo_trl.stages.interrupts import run_interruptible

    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "trainer_state.json").write_text("{}")
    cleaned = []
    before = signal.getsignal(signal.SIGTERM)

    def work():
        try:
            os.kill(os.getpid(), signum)
            time.sleep(30)
        finally:
            cleaned.append(True)

    # Python raises KeyboardInterrupt on SIGINT only if SIGINT was not ignored when it started, and a shell without
    # job control starts background jobs with SIGINT ignored (`bash .ci/run &`): give the test Ctrl-C's handler.
    sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert run_interruptible("appo sft", str(tmp_path), work) == 128 + signum
    finally:
        signal.signal(signal.SIGINT, sigint)
    assert cleaned == [True] and signal.getsignal(signal.SIGTERM) is before
    err = capsys.readouterr().err
    name = signal.Signals(signum).name
    assert err == f"appo sft: stopped by {name}; kept {tmp_path / 'checkpoint-3'} (continue with " \
        "--resume_from_checkpoint true); the steps after it are lost.\n"  # fmt: skip


FAKE_LAUNCHER = """
import subprocess, sys
# like `accelerate launch` with one process: start the rank, die on SIGTERM without passing it on
subprocess.Popen([sys.executable, "-c", sys.argv[1]]).wait()
"""
FAKE_RANK = """
import os, signal, sys, time
def stop(signum, frame):
    time.sleep(1.0)  # a graceful shutdown that takes a while (sandbox, engine threads)
    open(os.environ["DONE"], "w").write(str(os.getpid()))
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
open(os.environ["READY"], "w").write(str(os.getpid()))
time.sleep(60)
"""


def test_relaunched_run_passes_sigterm_to_its_ranks_and_waits(tmp_path):
    """`appo train --num_processes N` runs `accelerate launch` as a child: a SIGTERM to `appo train` reaches every
    rank, and `appo train` exits (143) only after they have, so none is left behind."""
    ready, done = tmp_path / "ready", tmp_path / "done"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "READY": str(ready), "DONE": str(done)}
    parent = (
        "import sys; from appo_trl.configs.recipes import run_launcher; "
        f"sys.exit(run_launcher([sys.executable, '-c', {FAKE_LAUNCHER!r}, {FAKE_RANK!r}], dict(__import__('os').environ)))"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], env=env)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.2)
        rank = int(ready.read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert done.exists() and int(done.read_text()) == rank  # the rank shut down gracefully, before the parent left
    assert not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE


WATCHED_RANK = """
import os, signal, sys, time
from appo_trl.stages import interrupts
grace = float(os.environ["GRACE"])
if grace:  # a shorter grace than a stage's, for the rank that does not stop
    interrupts.watch_launching_parent("appo train", grace=grace)
def work():
    try:
        if os.environ["STUCK"] == "1":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # like a main thread blocked in a C call
        open(os.environ["READY"], "w").write(str(os.getpid()))
        time.sleep(60)
    finally:
        open(os.environ["DONE"], "w").write("cleaned up")
sys.exit(interrupts.run_interruptible("appo train", None, work))
"""


def _kill_the_launching_parent(tmp_path, stuck: bool, grace: float):
    """`run_launcher` -> a launcher that passes no signal on -> a rank in `run_interruptible`; SIGKILL the
    parent once the rank runs. Returns (the parent's pid, seconds until the rank was gone, the rank's stderr,
    DONE's text)."""
    ready, done, log = tmp_path / "ready", tmp_path / "done", tmp_path / "stderr"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "READY": str(ready), "DONE": str(done),
           "STUCK": str(int(stuck)), "GRACE": str(grace)}  # fmt: skip
    parent = (
        "import sys; from appo_trl.configs.recipes import run_launcher; "
        f"sys.exit(run_launcher([sys.executable, '-c', {FAKE_LAUNCHER!r}, {WATCHED_RANK!r}], dict(__import__('os').environ)))"
    )
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", parent], env=env, stderr=err)
    rank = None
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() or not ready.read_text():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        rank = psutil.Process(int(ready.read_text()))
        proc.kill()  # kill -9 appo: nothing is forwarded; the launcher and the rank are in another session
        killed = time.monotonic()
        try:
            rank.wait(timeout=30)
        except psutil.TimeoutExpired:
            pass
        took = time.monotonic() - killed
    finally:
        proc.kill()
        proc.wait()
        if rank is not None and rank.is_running():
            rank.kill()
    return proc.pid, took, log.read_text(), done.read_text() if done.exists() else None


def test_a_rank_stops_when_the_appo_process_that_launched_it_is_killed(tmp_path):
    """`kill -9 appo` (or the OOM killer) reaches no rank: each rank sees the launching pid gone (the test keeps it
    a zombie until the end, so a bare existence check would miss it) and stops the SIGTERM way, cleanup included."""
    pid, took, err, done = _kill_the_launching_parent(tmp_path, stuck=False, grace=0)
    assert took < 5, f"the rank still ran {took:.0f} s after its appo process was killed"
    assert done == "cleaned up"  # the `finally` blocks ran (sandbox, engine threads in a real stage)
    assert err.endswith(
        f"appo train: stopped because the appo process that launched this rank (pid {pid}) is gone; "
        "no checkpoint was saved.\n"
    ), err


def test_a_rank_that_does_not_stop_is_ended_after_the_grace(tmp_path):
    _, took, err, done = _kill_the_launching_parent(tmp_path, stuck=True, grace=1.0)
    assert took < 6, f"the rank still ran {took:.0f} s after its appo process was killed"
    assert done is None  # ended with os._exit: no cleanup could run
    assert "is gone and this rank did not stop within 1 s; exiting now." in err, err


@pytest.mark.slow
def test_kill_9_of_a_launching_appo_train_leaves_no_rank(tiny_model_path, tmp_path):
    """A real `appo train --num_processes 1` (`accelerate launch` in its own session, the python sandbox running)
    is SIGKILLed once it trains: the launcher, the rank and the sandbox are all gone within seconds."""
    out, log = tmp_path / "run", tmp_path / "stderr"
    with open(log, "w") as err:  # a file: the ranks write to it after appo train is gone
        proc = _train(out, tiny_model_path, "--max_steps", "500", "--num_processes", "1", stderr=err)
    tree = []
    try:
        deadline = time.monotonic() + 480
        while last_complete_checkpoint(str(out), log=False) is None or not _sandboxed(tree):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint and sandbox after 480 s"
            time.sleep(0.2)
            tree = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        killed = time.monotonic()
        gone, alive = psutil.wait_procs(tree, timeout=20)
        took = time.monotonic() - killed
    finally:
        proc.kill()
        proc.wait()
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    left = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.cmdline() for p in left]
    assert took < 15, f"the launched processes ran {took:.0f} s after appo train was killed"
    err = log.read_text()
    stops = [line for line in err.splitlines() if "stopped because" in line]
    assert len(stops) == 1 and stops[0].startswith(
        f"appo train: stopped because the appo process that launched this rank (pid {proc.pid}) is gone; kept "
    ), err[-3000:]


def test_stop_line_never_names_an_earlier_runs_checkpoint(tmp_path):
    """Issue 34: a run that resumed nothing and saved nothing yet does not claim an earlier run's checkpoint."""
    from appo_trl.stages import interrupts

    old = tmp_path / "checkpoint-1"
    old.mkdir()
    (old / "trainer_state.json").write_text("{}")
    os.utime(old / "trainer_state.json", (1, 1))
    os.utime(old, (1, 1))
    assert "kept" in interrupts.stop_message("appo train", signal.SIGTERM, str(tmp_path))  # not known to be fresh
    interrupts.note_fresh_start(str(tmp_path))
    line = interrupts.stop_message("appo train", signal.SIGTERM, str(tmp_path))
    assert line == "appo train: stopped by SIGTERM; no checkpoint was saved by this run (checkpoint-1 in " \
        f"{tmp_path} is from an earlier run)."  # fmt: skip
    new = tmp_path / "checkpoint-2"
    new.mkdir()
    (new / "trainer_state.json").write_text("{}")  # saved by this run
    for f in (new / "trainer_state.json", new):  # the kernel's coarse file clock can read a tick before time.time()
        os.utime(f, (time.time() - 1, time.time() - 1))
    assert f"kept {new} (continue with" in interrupts.stop_message("appo train", signal.SIGTERM, str(tmp_path))
    shutil.rmtree(new)
    (old / "trainer_state.json").write_text("{}")  # this run saved step 1 again, over the earlier run's
    assert f"kept {old} (continue with" in interrupts.stop_message("appo train", signal.SIGTERM, str(tmp_path))
