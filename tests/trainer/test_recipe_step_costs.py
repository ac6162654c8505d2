"""The tiny appo recipe's step, counted on CPU by `bench/recipe_probe.py` (what `bench/gpu.py` records on a GPU, where
each sequential forward and each sync costs a launch-bound round trip): the sampler decodes the initial rollouts in
one batch and all branches in one more, and a step runs two tree forwards (APPO's scoring, whose log-probabilities
serve as TRL's old logps, and the loss)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_appo_step_decodes_in_two_batches_and_runs_two_tree_forwards(tiny_model_path, tmp_path):
    from bench.gpu import PROBE

    out, budget = tmp_path / "probe.json", 24
    cmd = [sys.executable, "-c", PROBE, str(ROOT), str(out), "--config", str(ROOT / "recipes/tiny/appo.yaml"),
           "--model_name_or_path", tiny_model_path, "--output_dir", str(tmp_path / "run"), "--max_steps", "2",
           "--max_completion_length", str(budget), "--save_strategy", "no", "--report_to", "none",
           "--tool_config", json.dumps({"python": {"isolation": "none"}})]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = json.loads(out.read_text())
    assert len(steps["step_s"]) == 2
    assert all(b == 2 for b in steps["decode_batches"]), steps
    assert all(0 < f <= 2 * budget for f in steps["decode_forwards"]), steps
    assert steps["tree_forwards"] == [2, 2], steps
    assert steps["compiles"] == [0, 0] and steps["host_syncs"] == [0, 0]  # CPU: no device to wait for
