"""Stopping a stage by signal: SIGTERM (what Slurm and Kubernetes send before SIGKILL) is handled like Ctrl-C.

`run_interruptible(prog, output_dir, fn)` runs `fn()` with a SIGTERM handler that raises `KeyboardInterrupt`
in the main thread, so a SIGTERM takes the same path as Ctrl-C: every `finally` runs on the way out (the rollout
engine's threads, the python sandbox and its cgroups, the tool and search workers are shut down; a checkpoint
save in progress removes its staging folder), then one line on stderr says which signal stopped the run and
which checkpoint is kept, and the exit code is 128 + the signal number (130 for Ctrl-C, 143 for SIGTERM). A
second SIGTERM while shutting down is ignored (the scheduler's SIGKILL ends a shutdown that hangs).

What is kept: every complete `checkpoint-N` (saves are atomic, `appo_trl.trainer.checkpoints`), the rollout
dumps and logs written so far. What is lost: the steps after the last checkpoint; `--resume_from_checkpoint
true` continues from it (with in-process, synchronous sampling on the very completions of the uninterrupted run;
docs/reference.md, "Checkpoints, interruptions and faults", says when not).

A rank launched by `appo train|sft --num_processes N` (or `--accelerate_config`) gets the pid of that `appo`
process in `APPO_PARENT_PID`. `accelerate launch` runs in a session of its own, so a SIGKILL of `appo` (`kill -9`,
the OOM killer) reaches no rank; instead `run_interruptible` starts a daemon thread that checks that pid twice a
second. When the process is gone (no such pid, a zombie, or the pid reused by a younger process), the rank stops
the SIGTERM way, and its one line says the launching process is gone; a rank whose main thread does not stop
within `grace` seconds (blocked in a C call, a collective whose peer is gone) is ended with `os._exit` after one
more line. The launcher then exits with its ranks.

A vLLM server or router that fails mid-run (`VLLMServerError`, `WeightSyncError`, `RouterError`, or an error
caused by one), and the user's agent stopping the run (`AgentError`: `agent_errors: raise`, a taken `agent_port`,
every run failing round after round), a reward function that returned no reward (`RewardFunctionError`) and
training that trains nothing (`GradNormError`: grad norms not finite) end the stage the same way: one line with the
error and the checkpoint kept, exit code 1 (`--debug` shows the traceback).

What this does not do: save a checkpoint on SIGTERM (transformers' `enable_jit_checkpoint` does, in the
trainer), or interrupt a main thread blocked in a C call before that call returns.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from appo_trl.configs.recipes import PARENT_PID_ENV

# the pid of the launching `appo` process, once the watchdog has found it gone (read by `run_interruptible`)
_parent_gone: list[int] = []
_watchdogs: list[threading.Thread] = []  # at most one per process (a stage may run several times in one)
# output_dir -> the checkpoints there (name -> mtimes) when a run that resumes nothing started training there
_fresh_starts: dict[str, dict[str, tuple[float, ...]]] = {}


def _signature(path: str) -> tuple[float, ...]:
    return tuple(os.path.getmtime(f) for f in (path, os.path.join(path, "trainer_state.json")) if os.path.exists(f))


def note_fresh_start(output_dir: str) -> None:
    """A run starts training in `output_dir` without resuming: a checkpoint there now is another run's.

    What is there is recorded by name and mtimes, not as a start time: a file's mtime comes from the kernel's coarse
    clock, which can lag `time.time()` by a tick, so a checkpoint saved just after the start could read as older."""
    root = os.path.abspath(output_dir)
    names = os.listdir(root) if os.path.isdir(root) else []
    _fresh_starts[root] = {n: _signature(os.path.join(root, n)) for n in names if n.startswith("checkpoint-")}


def _saved_since(path: str, before: dict[str, tuple[float, ...]]) -> bool:
    name = os.path.basename(path)
    return name not in before or before[name] != _signature(path)


class Stopped(KeyboardInterrupt):
    """The `KeyboardInterrupt` raised for a SIGTERM (`signum` says which signal)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM raises `Stopped` (a `KeyboardInterrupt`) in the main thread while the block runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the shutdown short
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _start_time(pid: int) -> int | None:
    """The start time of a live process `pid` (clock ticks since boot, /proc/PID/stat), None when it is gone
    or a zombie; -1 where /proc cannot say (then only the pid's existence is checked)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return -1
    return None if fields[0] in ("Z", "X") else int(fields[19])  # state; starttime (field 22)


def watch_launching_parent(
    prog: str, pid: int | None = None, interval: float = 0.5, grace: float = 10.0
) -> threading.Thread | None:
    """Stop this process when the `appo` process that launched it (`pid`, default `$APPO_PARENT_PID`) is gone.

    A daemon thread checks `pid` every `interval` seconds. When it is gone it sends SIGTERM to this process
    (`run_interruptible` turns it into the Ctrl-C path: cleanup, one line), and if this process still runs
    `grace` seconds later it prints one line and calls `os._exit(143)`. Returns the thread, or None when no
    parent pid is set or a watchdog already runs in this process.
    """
    if _watchdogs:
        return None
    if pid is None:
        value = os.environ.get(PARENT_PID_ENV, "")
        if not value.isdigit():
            return None
        pid = int(value)
    started = _start_time(pid)

    def watch():
        while True:
            now = _start_time(pid)
            if now is None or (started is not None and now != started):
                break
            time.sleep(interval)
        _parent_gone.append(pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        say(f"{prog}: the appo process that launched this rank (pid {pid}) is gone and this rank did not stop "
            f"within {grace:g} s; exiting now.")  # fmt: skip
        os._exit(128 + signal.SIGTERM)

    thread = threading.Thread(target=watch, name="appo-parent-watchdog", daemon=True)
    thread.start()
    _watchdogs.append(thread)
    return thread


def attach_stderr(pid: int | None = None) -> bool:
    """In a launched rank, write stderr to the launching `appo` process's own stderr (`/proc/PID/fd/2`, appended),
    not to the launcher's: `appo` drops what the launcher prints once it forwarded a signal (torch's traceback),
    and the ranks' lines must still get through, also after `appo` itself is gone. Returns whether it did."""
    if pid is None:
        value = os.environ.get(PARENT_PID_ENV, "")
        if not value.isdigit():
            return False
        pid = int(value)
    try:
        fd = os.open(f"/proc/{pid}/fd/2", os.O_WRONLY | os.O_APPEND)
    except OSError:
        return False
    sys.stderr.flush()
    os.dup2(fd, 2)
    os.close(fd)
    return True


def say(line: str) -> None:
    """`line` and its newline on stderr in one write: the lines of ranks stopping together never run together.
    Progress bars still open (the run stopped inside one) are closed first, so the line starts a line of its own."""
    try:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()
    except Exception:  # noqa: BLE001 - a bar that cannot close must not hide the stop line
        pass
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def kept_message(output_dir: str | None) -> str:
    """Which checkpoint a stopped run keeps and how to resume from it."""
    from appo_trl.trainer.checkpoints import last_complete_checkpoint

    last = last_complete_checkpoint(output_dir, log=False) if output_dir else None
    before = _fresh_starts.get(os.path.abspath(output_dir)) if output_dir else None
    if last is not None and before is not None and not _saved_since(last, before):
        return (f"no checkpoint was saved by this run ({os.path.basename(last)} in {output_dir} is from an earlier "
                "run)")  # fmt: skip
    if last is None:
        return f"no checkpoint was saved in {output_dir} yet" if output_dir else "no checkpoint was saved"
    return f"kept {last} (continue with --resume_from_checkpoint true); the steps after it are lost"


def stop_message(prog: str, signum: int, output_dir: str | None, parent_gone: int | None = None,
                 notes: tuple[str, ...] = ()) -> str:  # fmt: skip
    """The one line printed when a signal stops the stage: the signal (or the launching process gone, pid
    `parent_gone`), what the stop left behind (`notes`: a vLLM server an in-flight update could not resume), the
    checkpoint kept, how to resume."""
    if parent_gone is None:
        stopped = f"stopped by {signal.Signals(signum).name}"
    else:
        stopped = f"stopped because the appo process that launched this rank (pid {parent_gone}) is gone"
    return "; ".join([f"{prog}: {stopped}", *notes, f"{kept_message(output_dir)}."])


def ending_errors() -> tuple[type[BaseException], ...]:
    """The errors that end a stage with one line and exit code 1 (module docstring): a vLLM server or router that
    failed mid-run, and the user's agent stopping the run (`agent_errors: raise`, or every run failing for
    `max_failed_agent_rounds` rounds in a row), a reward function's broken output and grad norms that are not finite."""
    from appo_trl.trainer.agents import AgentError
    from appo_trl.trainer.grad_norms import GradNormError
    from appo_trl.trainer.reward_checks import RewardFunctionError
    from appo_trl.vllm import RouterError, VLLMServerError, WeightSyncError

    return (VLLMServerError, WeightSyncError, RouterError, AgentError, RewardFunctionError, GradNormError)


def ending_error(exc: BaseException) -> BaseException | None:
    """The `ending_errors` error behind `exc` (itself or a cause), None when there is none."""
    kinds, seen, depth = ending_errors(), exc, 0
    while seen is not None and depth < 8:
        if isinstance(seen, kinds):
            return seen
        seen, depth = seen.__cause__ or seen.__context__, depth + 1
    return None


def run_interruptible(prog: str, output_dir: str | None, fn: Callable[[], object]) -> int:
    """Run `fn()`; Ctrl-C or SIGTERM ends it with one line on stderr and exit code 128 + signal (130, 143).

    In a launched rank (`$APPO_PARENT_PID` set) the launching process is watched while `fn()` runs
    (`watch_launching_parent`).
    """
    with sigterm_as_ctrl_c():
        attach_stderr()
        watch_launching_parent(prog)
        try:
            fn()
        except KeyboardInterrupt as exc:
            signum = getattr(exc, "signum", signal.SIGINT)
            gone = _parent_gone[0] if _parent_gone and signum == signal.SIGTERM else None
            say(stop_message(prog, signum, output_dir, gone, tuple(getattr(exc, "__notes__", ()))))
            return 128 + signum
        except Exception as exc:
            line = ending_line(prog, exc, kept_message(output_dir))
            if line is None:
                raise
            say(line)
            return 1
    return 0


def ending_line(prog: str, exc: BaseException, kept: str = "") -> str | None:
    """The one line an `ending_errors` error behind `exc` ends a stage with (`kept`: what was kept, said after it);
    None (raise it) for any other error, and when debugging (`--debug`)."""
    from appo_trl.configs.errors import DEBUG_ENV, ConfigError, one_line

    cause = None if isinstance(exc, ConfigError) else ending_error(exc)
    if cause is None or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        return None
    return f"{prog}: error: {one_line(cause)}{f'; {kept}' if kept else ''} (run with --debug for the traceback)"
