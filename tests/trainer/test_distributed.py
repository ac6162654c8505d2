"""2-process (gloo, CPU) APPO run: per-rank groups, no collective inside variable-length loops, global
`num_items_in_batch` over the rows that reach the loss on both ranks."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


@pytest.mark.slow
def test_two_process_appo(tiny_model_path, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        os.path.join(HERE, "ddp_appo.py"),
        tiny_model_path,
        str(tmp_path),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=400, env=env, cwd=os.path.join(HERE, "..", "..")
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.load(open(tmp_path / "result.json"))
    assert result["ok"] and result["world"] == 2
    # each rank keeps 2 of its 4 rows; the normaliser is the sum over both ranks
    assert all(g > local for (_, local, _), g in zip(result["seen"], result["global"]))
