"""Cgroup directories left by a killed trainer (`appo-sandbox-<pid>-<hex>`) are removed at the next start (issue 21).

SIGKILL/SIGTERM of a trainer leaves its sandboxes' cgroup directories; the next sandbox start removes those whose
owner is gone (or whose pid was reused by a younger process) and leaves the others. The cgroup root is a fake
(a tmp folder laid out as cgroup v2), so this runs without root or writable cgroups; `rmdir` semantics match.
"""

from __future__ import annotations

import os
import subprocess
import time

from appo_trl.tools import isolation as iso


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_next_start_removes_cgroups_of_dead_owners(tmp_path, monkeypatch, caplog):
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    monkeypatch.setattr(iso, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(iso, "_cgroup_lines", lambda: [("", "/")])

    dead = root / f"appo-sandbox-{_dead_pid()}-0a1b2c3d"
    (dead / "0").mkdir(parents=True)  # a per-call cgroup inside, as a killed run leaves it
    (dead / "1").mkdir()
    sleeper = subprocess.Popen(["sleep", "30"])  # a live process on a pid that a killed run had used before
    try:
        reused = root / f"appo-sandbox-{sleeper.pid}-00ff00ff"
        reused.mkdir()
        old = time.time() - 3600
        os.utime(reused, (old, old))
        alive = root / f"appo-sandbox-{os.getppid()}-12345678"  # owner started before its directory: kept
        alive.mkdir()
        mine = root / f"appo-sandbox-{os.getpid()}-deadbeef"  # this process's other sandbox: kept
        mine.mkdir()
        other = root / "appo-sandbox-notes"  # not a sandbox cgroup name: never touched
        other.mkdir()
        with caplog.at_level("INFO", logger=iso.logger.name):
            binds, specs, made = iso.make_cgroups(256, 8, None)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not dead.exists() and not reused.exists()
    assert alive.exists() and mine.exists() and other.exists()
    assert len(made) == 1 and os.path.basename(made[0]).startswith(f"appo-sandbox-{os.getpid()}-")
    assert binds == ["--bind", made[0], "/cg/v2"]
    assert "removed 2 cgroup(s) left by killed runs" in caplog.text and str(dead) in caplog.text
