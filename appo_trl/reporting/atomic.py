"""Files written whole or not at all: the rollout dump's step files and the viewer's pages.

`write_whole(path, text)` writes a temp file beside `path` (`.<name>.<random>.tmp`, which no reader lists), flushes
and fsyncs it, and renames it over `path`: a kill or a full disk leaves `path` as it was, never cut or empty. The temp
file is removed on any error; one left by a SIGKILL is removed by the next write of the same file. A full disk
(ENOSPC, EDQUOT) is `DiskFullError`, one line naming the file and the free space, as a full disk at a checkpoint is.

What this does not do: fsync the folder (a power cut may lose the rename, never half a file).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path

from appo_trl.configs.errors import ConfigError


class DiskFullError(ConfigError, OSError):
    """A file could not be written (a full disk); the files written before are intact."""

    def __init__(self, message: str):
        super().__init__(message)
        self.errno = errno.ENOSPC


def write_whole(path: Path, text: str, *, append: bool = False, then: str = "free some space and run again") -> None:
    """`text` as the whole of `path` (after its current content with `append`), through a temp file renamed over
    it; a full disk is `DiskFullError` ending with `then` (what to do next)."""
    path = Path(path)
    folder = path.parent
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(f".{path.name}.*.tmp"):  # a killed write's temp file
            stale.unlink(missing_ok=True)
        old = path.read_bytes() if append and path.is_file() else b""
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(old + text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        try:
            free = f"{shutil.disk_usage(folder).free // 2**20} MiB free"
        except OSError:
            free = "free space unknown"
        raise DiskFullError(f"writing {path} failed: No space left on device ({free}); the files written before "
                            f"are intact: {then}") from exc  # fmt: skip
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
