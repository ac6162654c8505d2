"""2 training processes (gloo, CPU) through two fake vLLM replicas and the real `vllm-router`: one router and
one health monitor for the run (rank 0's, on a fixed `vllm_router_port`), rank 1 a read-only follower of it;
a replica killed after step 1 and back after step 2 is out of, then back in, both ranks' view at the same syncs.
"""

import json
import os
import subprocess
import sys

import pytest

from appo_trl.vllm.router import RouterError, free_port, router_executable

HERE = os.path.dirname(__file__)

try:
    router_executable()
    HAVE_ROUTER = True
except RouterError:
    HAVE_ROUTER = False


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.skipif(not HAVE_ROUTER, reason="vllm-router is not installed (pip install '.[router]')")
def test_two_processes_share_one_router_and_one_view_of_the_replicas(tiny_model_path, tmp_path):
    ports = [str(free_port()) for _ in range(3)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(HERE, "ddp_replicas.py"), tiny_model_path, str(tmp_path), *ports]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.join(HERE, "..", ".."))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.load(open(tmp_path / "result.json"))
    a, b = result["urls"]
    main, follower = result["records"]
    router = f"http://127.0.0.1:{ports[2]}"
    assert (main["owner"], main["router_process"], main["monitor"]) == (True, True, True)
    assert (follower["owner"], follower["router_process"], follower["monitor"]) == (False, False, False)
    assert main["router_url"] == follower["router_url"] == main["base_url"] == follower["base_url"] == router
    # B killed after step 1, back after step 2: out at sync 2, back in at sync 3, on both ranks alike
    assert main["views"] == follower["views"] == [sorted([a, b]), [a], sorted([a, b])]  # views are sorted
    assert main["rejoins"] == follower["rejoins"] == 1 and main["down_events"] == follower["down_events"] == 1
    assert main["ups"] == follower["ups"] == [2, 1, 2]
