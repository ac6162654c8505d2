"""Benchmarks that do not rot: every `bench/*.py` runs with `--quick --json` and prints one JSON object.

The figures are not asserted (the machine is shared and timings vary); only that each benchmark imports
from the package and `bench/` alone (never `tests/`), runs to the end, and ends with a JSON object.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _benchmarks() -> list[Path]:
    """The runnable benchmarks: bench/*.py files with a `__main__` block (fake_vllm.py is a helper module)."""
    return sorted(p for p in BENCH.glob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def test_benchmarks_are_found():
    assert {p.stem for p in _benchmarks()} >= {"trainer", "rollout", "tools"}


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_bench_never_imports_tests(path):
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.split(".")[0] == "tests"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tests":
            bad.append(node.module)
    assert not bad, f"{path.name} imports from tests/: {bad}"


@pytest.mark.parametrize("path", [p for p in sorted(BENCH.glob("*.py"))], ids=lambda p: p.name)
def test_bench_accepts_quick_and_json(path):
    if path not in _benchmarks():
        pytest.skip("helper module, not a benchmark")
    text = path.read_text()
    assert '"--quick"' in text and '"--json"' in text


def _run_json(path: Path, tmp_path, *extra: str) -> dict:
    """Run one benchmark with `--quick --json` (and `extra`) from another directory; its last line's JSON object."""
    # this tree's package (not another install), run from another directory
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(BENCH.parent)}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(path), "--quick", "--json", *extra],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stderr[-3000:]}"
    last = [line for line in proc.stdout.splitlines() if line.strip()][-1]
    figures = json.loads(last)
    assert isinstance(figures, dict) and figures
    return figures


@pytest.mark.slow
@pytest.mark.parametrize("path", _benchmarks(), ids=lambda p: p.stem)
def test_bench_quick_json_runs(path, tmp_path):
    _run_json(path, tmp_path)


@pytest.mark.slow
def test_tree_forward_peak_memory_runs(tmp_path):
    """`bench/tree_forward.py --peak` (spawned children, one per path) is not part of `--quick`: run it once."""
    figures = _run_json(BENCH / "tree_forward.py", tmp_path, "--workload", "a_quick", "--strategy", "grpo", "--peak")
    assert {"tree_a_quick_grpo_peak_rss_mb_row", "tree_a_quick_grpo_peak_rss_mb_tree"} <= set(figures)
