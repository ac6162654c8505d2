"""The launch of the distributed engines, checked before anything loads (no process is started here).

- the shipped accelerate configs say `mixed_precision: bf16`; `appo train` launches in the recipe's precision,
  a contradicting `--mixed_precision` is one line, and a rank launched by hand under DeepSpeed names the
  mismatch before the model loads (transformers would fail after loading: `ds bf16.enabled=True vs hf bf16=False`);
- FSDP on CPU (accelerate would silently train DDP) is one line;
- DeepSpeed's CPU shm comm op is marked unbuildable under a DeepSpeed launch on CPU, so no JIT build runs.
"""

import pytest

from appo_trl.configs.errors import PreflightError
from appo_trl.configs.recipes import REPO_ROOT, check_before_relaunch, launch_command, parse_recipe, split_launch_args
from appo_trl.stages.train import dataclass_types

TINY = str(REPO_ROOT / "recipes" / "tiny" / "grpo.yaml")


def _argv(*extra):
    return ["--config", TINY, "--model_name_or_path", "tiny", *extra]


@pytest.fixture(autouse=True)
def clean_launch_env(monkeypatch):
    for key in ("APPO_LAUNCHED", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("engine", ["zero2", "zero3", "ddp"])
def test_launch_trains_in_the_recipes_precision(engine):
    argv = _argv("--accelerate_config", engine, "--num_processes", "2")
    precision = check_before_relaunch(dataclass_types(), argv)
    assert precision == "no"  # the tiny recipe: bf16: false
    launch, rest = split_launch_args(argv)
    cmd = launch_command(launch, "train.py", rest, precision)
    assert cmd[cmd.index("--mixed_precision") + 1] == "no"  # not the config file's bf16
    bf16 = _argv("--bf16", "true", "--accelerate_config", engine)
    assert check_before_relaunch(dataclass_types(), bf16) == "bf16"


def test_contradicting_mixed_precision_flag_is_one_line():
    argv = _argv("--accelerate_config", "zero3", "--num_processes", "2", "--mixed_precision", "bf16")
    with pytest.raises(
        PreflightError, match=r"mixed_precision=bf16 but the recipe trains in no.*--mixed_precision no"
    ):
        check_before_relaunch(dataclass_types(), argv)
    check_before_relaunch(dataclass_types(), argv[:-1] + ["no"])  # agreeing: fine


def test_rank_launched_by_hand_names_the_mismatch(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setattr("appo_trl.configs.preflight.skip_deepspeed_cpu_comm_build", lambda: False)
    with pytest.raises(
        PreflightError, match="accelerate launch .* sets mixed_precision=bf16 but the recipe trains in no"
    ):
        parse_recipe(dataclass_types(), _argv())
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    parse_recipe(dataclass_types(), _argv())
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")  # DDP: transformers follows the recipe, nothing to check
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    parse_recipe(dataclass_types(), _argv())


def test_fsdp_on_cpu_is_one_line(monkeypatch):
    with pytest.raises(PreflightError, match="FSDP only on GPUs.*use_cpu: true.*zero2 or zero3"):
        check_before_relaunch(dataclass_types(), _argv("--accelerate_config", "fsdp", "--num_processes", "2"))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # a rank launched by hand with fsdp.yaml
    with pytest.raises(PreflightError, match="FSDP only on GPUs"):
        parse_recipe(dataclass_types(), _argv())


def test_deepspeed_cpu_comm_op_is_not_built(monkeypatch):
    pytest.importorskip("deepspeed")
    import deepspeed.ops
    from deepspeed.comm.torch import build_shm_op

    from appo_trl.configs.preflight import skip_deepspeed_cpu_comm_build

    ops = deepspeed.ops.__compatible_ops__
    monkeypatch.setitem(ops, "deepspeed_shm_comm", ops.get("deepspeed_shm_comm", False))
    assert skip_deepspeed_cpu_comm_build() is False  # not a DeepSpeed launch: untouched
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert skip_deepspeed_cpu_comm_build() is True
    assert build_shm_op() is None  # what DeepSpeed's TorchBackend calls at init_distributed: no JIT build
