"""Benchmarks that do not rot: every `bench/*.py` runs with `--quick --json` and prints one JSON object.

The figures are not asserted (the machine is shared and timings vary); only that each benchmark imports
from the package and `bench/` alone (never `tests/`), runs to the end, and ends with a JSON object.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
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
    # this tree's package (not another install), run from another directory; its temporary files in a folder of
    # their own, which must be empty afterwards (torch's compile cache, kept on purpose, goes elsewhere)
    # (a short path: Chromium's profile socket must fit a Unix socket path, 108 bytes, which tmp_path does not)
    scratch = Path(tempfile.mkdtemp(prefix="appo-bench-tmp-"))
    try:
        return _run_in(path, tmp_path, scratch, extra)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_in(path: Path, tmp_path, scratch: Path, extra: tuple[str, ...]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(BENCH.parent), "TMPDIR": str(scratch),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "triton")}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(path), "--quick", "--json", *extra],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stderr[-3000:]}"
    left = sorted(p.name for p in scratch.iterdir())
    assert not left, f"{path.name} left temporary files behind: {left}"
    last = [line for line in proc.stdout.splitlines() if line.strip()][-1]
    figures = json.loads(last)
    assert isinstance(figures, dict) and figures
    return figures


@pytest.mark.slow
@pytest.mark.parametrize("path", _benchmarks(), ids=lambda p: p.stem)
def test_bench_quick_json_runs(path, tmp_path):
    _run_json(path, tmp_path)


@pytest.mark.slow
def test_inflight_with_the_server_in_its_own_process_runs(tmp_path):
    """`bench/inflight.py --server-process` (the scripted server spawned, as vLLM runs) is not part of `--quick`."""
    figures = _run_json(BENCH / "inflight.py", tmp_path, "--server-process", "--modes", "overlap,keep")
    assert figures["server"] == "process" and figures["keep_step_s"] > 0
    assert figures["keep_server_idle"] < 1.0  # the child's request count reached this process


@pytest.mark.slow
def test_tree_forward_peak_memory_runs(tmp_path):
    """`bench/tree_forward.py --peak` (spawned children, one per path) is not part of `--quick`: run it once."""
    figures = _run_json(BENCH / "tree_forward.py", tmp_path, "--workload", "a_quick", "--strategy", "grpo", "--peak")
    assert {"tree_a_quick_grpo_peak_rss_mb_row", "tree_a_quick_grpo_peak_rss_mb_tree"} <= set(figures)


def test_saved_bytes_counts_what_autograd_saves_and_keeps_none():
    """`saved_mb` is the bytes a non-checkpointed forward saves for the backward, counted without holding them
    (workload (a)'s row-wise forward would hold 6-8 GiB), and checkpointing is back on afterwards."""
    import torch

    from bench.tree_forward import CHECKPOINTING, WORKLOADS, build_model, forward, group_rows, saved_bytes, trl_layout

    prompt, n, comp, tool, hidden, layers, vocab = WORKLOADS["a_quick"]
    model = build_model(hidden, layers, vocab, prompt + comp + 8)
    assert model.is_gradient_checkpointing  # the trainer's default, on both paths
    ids, mask, c = trl_layout(group_rows("arpo", prompt, n, comp, tool, vocab, seed=1))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for tree in (False, True):
        kept = {}

        def pack(t, kept=kept):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                kept[storage.data_ptr()] = storage.nbytes()
            return t

        model.gradient_checkpointing_disable()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            held = forward(model, ids, mask, c, tree, entropy=True)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=CHECKPOINTING)
        del held
        nbytes, (logps, _) = saved_bytes(model, lambda t=tree: forward(model, ids, mask, c, t, entropy=True))
        assert nbytes == sum(kept.values()) > 0
        assert model.is_gradient_checkpointing
        with pytest.raises(RuntimeError, match="dropped"):
            logps.sum().backward()


def test_full_workload_a_runs_each_strategy_in_its_own_process(monkeypatch):
    """Full-size workload (a) never builds its model in the calling process (`bench/trainer.py`'s), and each
    strategy's step runs in a fresh process, so one strategy's memory is returned before the next starts."""
    import bench.tree_forward as tf

    calls = []
    monkeypatch.setattr(tf, "_spawned", lambda target, *args: calls.append((target.__name__, args)) or {"x": 1.0})
    monkeypatch.setattr(tf, "build_model", lambda *a, **kw: pytest.fail("workload (a) built in the parent"))
    figures = tf.tree_figures(False, workloads=("a",))
    assert calls == [("_measure_child", ("a", "grpo", 1, True)), ("_measure_child", ("a", "arpo", 1, True))]
    assert figures == {"tree_a_grpo_x": 1.0, "tree_a_arpo_x": 1.0}


def test_spawned_child_that_dies_raises_instead_of_waiting():
    """A spawned measurement that dies without a result (an error, the OOM killer) fails the benchmark at once."""
    from bench.tree_forward import _spawned

    with pytest.raises(RuntimeError, match="without a result"):
        _spawned(os._exit, 3)  # the child calls os._exit(3, queue): a TypeError, exit code 1
