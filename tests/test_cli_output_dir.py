"""An `output_dir` that refuses writes is one line and exit 2 before the model loads, not an error at the first save.

As root the read-only case mounts a read-only tmpfs; elsewhere a folder without write permission stands in
(root ignores permission bits, so there the mount is needed).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from appo_trl.cli import main as appo
from tests.test_cli_errors import one_error_line, recipe, workdir  # noqa: F401  (workdir: a fixture)


@pytest.fixture
def read_only_dir(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs: {done.stderr.decode().strip()}")
        try:
            yield folder
        finally:
            subprocess.run(["umount", "-l", str(folder)], check=False)
    else:
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)


def test_read_only_output_dir_fails_before_the_model_loads(workdir, read_only_dir, capfd):  # noqa: F811
    assert appo(["train", "--config", recipe(workdir, output_dir=str(read_only_dir / "run"))]) == 2
    line = one_error_line(capfd)
    assert f"output_dir '{read_only_dir / 'run'}' is not writable" in line and "--output_dir" in line


def test_output_dir_under_a_file_fails_before_the_model_loads(workdir, capfd):  # noqa: F811
    (workdir / "afile").write_text("x")
    assert appo(["train", "--config", recipe(workdir, output_dir="afile/run")]) == 2
    line = one_error_line(capfd)
    assert "output_dir 'afile/run' cannot be created" in line and "is a file" in line
