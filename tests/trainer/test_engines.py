"""RL under the distributed engines the README promises, 2 CPU processes (gloo): DeepSpeed ZeRO-2, ZeRO-3, FSDP2.

One `accelerate launch` per engine trains grpo, arpo, aepo and appo for 2 steps each (`engines_worker.py`), with
the shipped accelerate config and no `--mixed_precision` flag where `appo train` would pass the recipe's. In grpo
and appo rank 1's rollouts all end after one token (no tool call, no APPO branch candidate), so its sampler runs
far fewer forwards than rank 0's: the run must still finish. Every launch trains with a small `tree_token_budget`
(TREE_BUDGET): rank 0's rows then need several tries per trainer forward and rank 1's one, so under ZeRO-3 and
FSDP2, where every forward and backward gathers parameters, rank 1 must run padding forwards (the tree forward
agrees on the maximum count over ranks) or the run hangs; under ZeRO-2 (parameters whole on every rank) no rank
pads. Under ZeRO-3 the worker sets `stage3_param_persistence_threshold: 0` (`shard_every_zero3_param`): the tiny
model's parameters are all below DeepSpeed's default (1e5 elements), which would keep them whole on every rank.
A run that stalls past the timeout fails the test with every rank's stack (SIGUSR1 -> faulthandler in the worker).

FSDP: accelerate keeps FSDP only on GPUs and silently trains DDP on CPU; `appo train` says so in one line
(`test_fsdp_on_cpu_is_one_line`). `test_rl_under_fsdp2` forces accelerate's FSDP2 plugin onto CPU in the worker
(see its docstring) and checks the same as under DeepSpeed; `test_fsdp2_round_gather` checks the round gather's
exact logits with torch's `fully_shard` directly.
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
# unique tokens per trie: the tiny recipes' prompts (about 150 tokens) with rank 1's 4 one-token completions fit
# one trie; rank 0's 16-token completions need several (the test checks that the ranks' tries differed)
TREE_BUDGET = 176


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
        os.path.join(HERE, "engines_worker.py"), model_path, str(out), str(TREE_BUDGET),
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


def check_tree_forwards(strategy, r, sharded):
    """Every trainer forward ran as a tree forward on both ranks. Sharded parameters: outside a round the ranks
    agreed on the forward count (tries + padding equal, only the rank with fewer tries pads); inside a round (APPO's
    selection on full weights) and with whole parameters (ZeRO-2) there is no agreement and nobody pads."""
    rank0, rank1 = r["tree_calls"]
    assert len(rank0) == len(rank1) > 0, (strategy, r["tree_calls"])
    for (t0, p0, a0), (t1, p1, a1) in zip(rank0, rank1):
        assert a0 == a1, (strategy, r["tree_calls"])
        if a0:
            assert t0 + p0 == t1 + p1 and min(p0, p1) == 0, (strategy, r["tree_calls"])
        else:
            assert p0 == p1 == 0, (strategy, r["tree_calls"])
    assert any(agreed for _, _, agreed in rank0) == sharded, (strategy, r["tree_calls"])
    if r["uneven"]:  # the case the padding exists for did happen: rank 1 had fewer tries than rank 0
        fewer = [agreed for (t0, _, agreed), (t1, _, _) in zip(rank0, rank1) if t1 < t0]
        assert fewer and any(fewer) == sharded, (strategy, r["tree_calls"])


def check_strategies(out, result, initial, sharded):
    """Per strategy: 2 steps, parameters moved and identical on both ranks, sharded or not as the engine says,
    the tree forwards (`check_tree_forwards`), and the final model and checkpoint-2 load with plain transformers
    (`from_pretrained`, no conversion) to exactly the trained parameters."""
    from transformers import AutoModelForCausalLM

    for strategy in STRATEGIES:
        r = result[strategy]
        assert r["steps"] == 2 and r["identical_across_ranks"], (strategy, r)
        assert r["sharded_frac"] > 0.9 if sharded else r["sharded_frac"] == 0, (strategy, r)
        if r["uneven"]:  # rank 1 sampled one token per segment: far fewer forwards, and no hang
            assert r["forwards"][1] * 3 < r["forwards"][0], (strategy, r)
        check_tree_forwards(strategy, r, sharded=sharded)
        final = torch.load(out / strategy / "final.pt")
        assert any(not torch.equal(final[k], initial[k]) for k in initial), f"{strategy}: parameters did not move"
        for path in (out / strategy, out / strategy / "checkpoint-2"):
            loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
            for k in final:
                torch.testing.assert_close(loaded[k].float(), final[k], rtol=0, atol=0, msg=f"{strategy} {path} {k}")


@pytest.mark.slow
@pytest.mark.parametrize("engine,stage,port", [("zero2", 2, 29561), ("zero3", 3, 29562)])
def test_rl_under_deepspeed(runs, engine, stage, port, tiny_model_path, tmp_path_factory):
    out, result, log = _run(runs, engine, tiny_model_path, tmp_path_factory, port)
    assert "deepspeed_shm_comm" not in log  # the CPU comm op is not JIT-built (appo_trl.configs.preflight)
    for strategy in STRATEGIES:
        r = result[strategy]
        assert r["distributed_type"] == "DistributedType.DEEPSPEED" and r["zero_stage"] == stage, r
    check_strategies(out, result, _initial(tiny_model_path), sharded=stage == 3)


@pytest.mark.slow
def test_rl_under_fsdp2(runs, tiny_model_path, tmp_path_factory):
    """FSDP2 through accelerate's own plugin, forced onto CPU (gloo) in the worker.

    `accelerate launch --config_file accelerate_configs/fsdp.yaml` exports the FSDP2 plugin settings, but on CPU
    accelerate's `AcceleratorState` keeps `MULTI_CPU` and drops the plugin (its FSDP branch is for GPU backends
    only), and `appo train` stops there with one preflight line, which is what users on CPU get (each rank checks
    it here first). The worker then skips that check and applies accelerate's two FSDP assignments
    (`distributed_type = FSDP`, the plugin) on CPU too (`engines_worker.force_fsdp_on_cpu`); the wrap (torch's
    `fully_shard` per decoder layer), the training steps and the full-state-dict saves are accelerate's,
    transformers' and TRL's own code. The parameters are DTensor shards during training; the rest is checked as
    under DeepSpeed.
    """
    out, result, _ = _run(runs, "fsdp", tiny_model_path, tmp_path_factory, 29563)
    for strategy in STRATEGIES:
        r = result[strategy]
        assert r["distributed_type"] == "DistributedType.FSDP" and r["fsdp_version"] == 2, (strategy, r)
        assert r["fsdp_cpu_error"].startswith("accelerate runs FSDP only on GPUs"), (strategy, r)
    check_strategies(out, result, _initial(tiny_model_path), sharded=True)


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
