"""RL under the distributed engines the README promises, 2 CPU processes (gloo): DeepSpeed ZeRO-2 and ZeRO-3.

One `accelerate launch` per engine trains grpo, arpo, aepo and appo for 2 steps each (`engines_worker.py`), with
the shipped accelerate config and no `--mixed_precision` flag where `appo train` would pass the recipe's. In grpo
and appo rank 1's rollouts all end after one token (no tool call, no APPO branch candidate), so its sampler runs
far fewer forwards than rank 0's: the run must still finish. A run that stalls past the timeout fails the test
with every rank's stack (SIGUSR1 -> faulthandler in the worker).

FSDP: accelerate keeps FSDP only on GPUs and silently trains DDP on CPU; `appo train` says so in one line
(`test_fsdp_on_cpu_is_one_line`). The FSDP2 round gather itself is checked by `test_fsdp2_round_gather`.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from appo_trl.configs.recipes import REPO_ROOT

HERE = os.path.dirname(__file__)
STRATEGIES = ("grpo", "arpo", "aepo", "appo")
TIMEOUT_S = int(os.environ.get("APPO_ENGINES_TIMEOUT_S", "420"))


def _stacks_and_kill(proc, out) -> str:
    """SIGUSR1 to each rank (faulthandler prints every thread's stack), then end the launch's process group."""
    pids = []
    for name in sorted(os.listdir(out / "pids")) if (out / "pids").is_dir() else []:
        pids.append(int((out / "pids" / name).read_text()))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(3)
    os.killpg(proc.pid, signal.SIGKILL)
    stdout, stderr = proc.communicate()
    return stdout + stderr


def run_ranks(cmd, out, what):
    """Run a 2-process launch; past TIMEOUT_S fail with every rank's stack. Returns its log."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "APPO_LAUNCHED": "",
           "ENGINES_WATCHDOG_S": str(TIMEOUT_S + 30)}  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"{what}: no result after {TIMEOUT_S} s; each rank's stack:\n" + _stacks_and_kill(proc, out)[-20000:]
        )
    log = stdout + stderr
    assert proc.returncode == 0, log[-6000:]
    return log


def launch(engine, model_path, out, port):
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(REPO_ROOT / "accelerate_configs" / f"{engine}.yaml"), "--num_processes", "2",
        "--mixed_precision", "no", "--main_process_port", str(port),
        os.path.join(HERE, "engines_worker.py"), model_path, str(out),
    ]  # fmt: skip
    log = run_ranks(cmd, out, engine)
    return json.loads((out / "result.json").read_text()), log


@pytest.fixture(scope="module")
def runs():
    return {}


def _run(runs, engine, tiny_model_path, tmp_path_factory, port):
    if engine not in runs:
        out = tmp_path_factory.mktemp(engine)
        runs[engine] = (out, *launch(engine, tiny_model_path, out, port))
    return runs[engine]


def _initial(model_path):
    from transformers import AutoModelForCausalLM

    return {k: v.float() for k, v in AutoModelForCausalLM.from_pretrained(model_path).state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("engine,stage,port", [("zero2", 2, 29561), ("zero3", 3, 29562)])
def test_rl_under_deepspeed(runs, engine, stage, port, tiny_model_path, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out, result, log = _run(runs, engine, tiny_model_path, tmp_path_factory, port)
    initial = _initial(tiny_model_path)
    assert "deepspeed_shm_comm" not in log  # the CPU comm op is not JIT-built (appo_trl.configs.preflight)
    for strategy in STRATEGIES:
        r = result[strategy]
        assert r["distributed_type"] == "DistributedType.DEEPSPEED" and r["zero_stage"] == stage, r
        assert r["steps"] == 2 and r["identical_across_ranks"], (strategy, r)
        if r["uneven"]:  # rank 1 sampled one token per segment: far fewer forwards, and no hang
            assert r["forwards"][1] * 3 < r["forwards"][0], (strategy, r)
        final = torch.load(out / strategy / "final.pt")
        assert any(not torch.equal(final[k], initial[k]) for k in initial), f"{strategy}: parameters did not move"
        for path in (out / strategy, out / strategy / "checkpoint-2"):  # plain transformers, no conversion
            loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
            for k in final:
                torch.testing.assert_close(loaded[k].float(), final[k], rtol=0, atol=0, msg=f"{strategy} {path} {k}")


@pytest.mark.slow
def test_fsdp2_round_gather(tiny_model_path, tmp_path):
    """FSDP2 (torch's `fully_shard` on CPU, gloo): unequal forward counts inside the round, exact logits, and the
    layers sharded again afterwards (accelerate itself runs FSDP only on GPUs)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(HERE, "engines_worker.py"), "fsdp2", tiny_model_path, str(tmp_path)]  # fmt: skip
    run_ranks(cmd, tmp_path, "fsdp2")
    for rank in json.loads((tmp_path / "fsdp2.json").read_text()):
        assert rank["max_logit_diff"] == 0.0 and rank["unsharded_inside"], rank
        assert rank["resharded_after"] and rank["resharded_after_forward"] and rank["grad"], rank
