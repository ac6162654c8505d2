"""Stopping a stage by signal: SIGTERM (what Slurm and Kubernetes send before SIGKILL) is handled like Ctrl-C.

`run_interruptible(prog, output_dir, fn)` runs `fn()` with a SIGTERM handler that raises `KeyboardInterrupt`
in the main thread, so a SIGTERM takes the same path as Ctrl-C: every `finally` runs on the way out (the rollout
engine's threads, the python sandbox and its cgroups, the tool and search workers are shut down; a checkpoint
save in progress removes its staging folder), then one line on stderr says which signal stopped the run and
which checkpoint is kept, and the exit code is 128 + the signal number (130 for Ctrl-C, 143 for SIGTERM). A
second SIGTERM while shutting down is ignored (the scheduler's SIGKILL ends a shutdown that hangs).

What is kept: every complete `checkpoint-N` (saves are atomic, `appo_trl.trainer.checkpoints`), the rollout
dumps and logs written so far. What is lost: the steps after the last checkpoint; `--resume_from_checkpoint
true` continues from it and samples what the uninterrupted run would have.

What this does not do: save a checkpoint on SIGTERM (transformers' `enable_jit_checkpoint` does, in the
trainer), or interrupt a main thread blocked in a C call before that call returns.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator


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


def stop_message(prog: str, signum: int, output_dir: str | None) -> str:
    """The one line printed when a signal stops the stage: the signal, the checkpoint kept, how to resume."""
    from appo_trl.trainer.checkpoints import last_complete_checkpoint

    name = signal.Signals(signum).name
    last = last_complete_checkpoint(output_dir, log=False) if output_dir else None
    if last is None:
        kept = f"no checkpoint was saved in {output_dir} yet" if output_dir else "no checkpoint was saved"
    else:
        kept = f"kept {last} (continue with --resume_from_checkpoint true); the steps after it are lost"
    return f"{prog}: stopped by {name}; {kept}."


def run_interruptible(prog: str, output_dir: str | None, fn: Callable[[], object]) -> int:
    """Run `fn()`; Ctrl-C or SIGTERM ends it with one line on stderr and exit code 128 + signal (130, 143)."""
    with sigterm_as_ctrl_c():
        try:
            fn()
        except KeyboardInterrupt as exc:
            signum = getattr(exc, "signum", signal.SIGINT)
            print(stop_message(prog, signum, output_dir), file=sys.stderr, flush=True)
            return 128 + signum
    return 0
