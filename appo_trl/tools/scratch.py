"""Scratch files a run keeps outside `output_dir` (filtered data rows, the vLLM disk-sync folder, the router log).

`scratch_path(kind)` creates `<tmp>/appo-<kind>-<pid>-<random><suffix>`, removed when this process exits; a run
that is killed (SIGKILL, the OOM killer) cannot remove its own, so every `scratch_path` call first removes those
of every kind in `KINDS` whose owner process is gone, as the python sandbox does with its cgroups
(`appo_trl.tools.isolation.remove_stale_cgroups`).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import tempfile

from appo_trl.tools.isolation import stale_pid_entries

logger = logging.getLogger(__name__)
_OWNED: list[str] = []
KINDS = ("rows", "vllm-weights", "vllm-router")  # the scratch files appo makes


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except OSError:
            pass


@atexit.register
def _remove_owned() -> None:
    while _OWNED:
        _remove(_OWNED.pop())


def remove_stale(kinds: tuple[str, ...] = KINDS, folder: str | None = None) -> list[str]:
    """Remove `appo-<kind>-<pid>-*` under `folder` (default: the temp folder) whose process `pid` is gone
    (or was reused by a process started after the entry last changed). Returns the removed paths (logged)."""
    folder = folder or tempfile.gettempdir()
    pattern = re.compile(rf"^appo-(?:{'|'.join(map(re.escape, kinds))})-(\d+)-")
    removed = []
    for path in stale_pid_entries(folder, pattern):
        _remove(path)
        removed.append(path)
    if removed:
        logger.info("removed %d scratch file(s) left by killed runs: %s", len(removed), ", ".join(removed))
    return removed


def scratch_path(kind: str, suffix: str = "", directory: bool = False) -> str:
    """A new file (or folder) `appo-<kind>-<pid>-<random><suffix>` in the temp folder, removed at exit."""
    if kind not in KINDS:
        raise ValueError(f"scratch kind {kind!r} is not one of {KINDS}")
    remove_stale()
    prefix = f"appo-{kind}-{os.getpid()}-"
    if directory:
        path = tempfile.mkdtemp(prefix=prefix, suffix=suffix)
    else:
        fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix)
        os.close(fd)
    _OWNED.append(path)
    return path


def release(path: str) -> None:
    """Remove a scratch path now (it is no longer needed before exit)."""
    if path in _OWNED:
        _OWNED.remove(path)
    _remove(path)


__all__ = ["release", "remove_stale", "scratch_path"]
