"""2 training processes (gloo, CPU) with the adapter-only sync (tests/trainer/ddp_lora.py): both ranks name the
same adapter version after every sync, only the main process loads it (once per sync), and every request of
either rank names a loaded version."""

import json
import os
import subprocess
import sys

import pytest

from appo_trl.vllm.router import free_port

HERE = os.path.dirname(__file__)


@pytest.mark.slow
def test_two_processes_name_the_same_adapter_and_load_it_once(tiny_model_path, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(HERE, "ddp_lora.py"), tiny_model_path, str(tmp_path), str(free_port())]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.join(HERE, "..", ".."))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.load(open(tmp_path / "result.json"))
    main, other = result["records"]
    assert main["route"] == other["route"] == "adapter" and main["prefix"] == other["prefix"]
    assert main["names"] == other["names"] and len(main["names"]) == 2 and len(set(main["names"])) == 2
    loads = [e[5:] for e in result["events"] if e.startswith("load:")]
    assert loads == main["names"]  # the main process loads each version once
    assert [e[7:] for e in result["events"] if e.startswith("unload:")] == main["names"][:1]
    assert len(result["models"]) == 16 and set(result["models"]) == set(main["names"])  # 2 ranks x 2 rounds x 4
