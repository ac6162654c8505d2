"""APPOConfig: defaults per strategy, documented fields and the invalid combinations that must fail early."""

from __future__ import annotations

import dataclasses

import pytest
from trl import GRPOConfig

from appo_trl.config import APPOConfig

BASE = dict(output_dir="/tmp/appo-config-test", use_cpu=True, bf16=False, report_to="none", save_strategy="no")


def make(**kw):
    return APPOConfig(**{**BASE, "num_generations": 4, "per_device_train_batch_size": 4, **kw})


def test_every_new_field_is_documented():
    base = {f.name for f in dataclasses.fields(GRPOConfig)}
    new = [f for f in dataclasses.fields(APPOConfig) if f.name not in base]
    assert len(new) >= 30
    assert all(f.metadata.get("help") for f in new), [f.name for f in new if not f.metadata.get("help")]


@pytest.mark.parametrize(
    "strategy,initial,loss_mode",
    [("grpo", 4, "clip"), ("arpo", 2, "clip"), ("aepo", 2, "entropy_balanced"), ("appo", 2, "future_kl")],
)
def test_strategy_defaults(strategy, initial, loss_mode):
    cfg = make(rollout_strategy=strategy)
    assert (cfg.initial_rollouts, cfg.loss_mode) == (initial, loss_mode)
    assert cfg.drops_branch_rows == (strategy == "appo")


def test_aepo_balanced_clipping_selects_its_loss_and_branch_cap_default():
    assert make(rollout_strategy="aepo", loss_mode="entropy_balanced").loss_mode == "entropy_balanced"
    # ⌈(8 - 3) / 3⌉ + 1 = 3
    cfg = make(
        rollout_strategy="appo",
        num_generations=8,
        per_device_train_batch_size=8,
        initial_rollouts=3,
        steps_per_generation=1,
    )
    assert cfg.max_branches_per_rollout == 3


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(rollout_strategy="ppo"), "rollout_strategy"),
        (dict(rollout_strategy="grpo", initial_rollouts=2), "does not branch"),
        (dict(rollout_strategy="appo", initial_rollouts=5), "initial_rollouts"),
        (dict(loss_mode="fipo"), "loss_mode"),
        (dict(rollout_strategy="arpo", dynamic_rollouts=True), "AEPO option"),
        (dict(rollout_strategy="aepo", entropy_balanced_clipping=True, loss_mode="clip"), "entropy_balanced"),
        (dict(rollout_strategy="appo", loss_type="luspo"), "loss_type"),
        (dict(clip_ratio_c=1.0), "clip_ratio_c"),
        (dict(fv_gamma=0.0), "fv_gamma"),
        (dict(advantage_mode="tree"), "advantage_mode"),
        (dict(use_vllm=True, vllm_mode="remote"), "vllm_mode='remote'; choose server"),
        (dict(use_vllm=True, vllm_mode="colocate", vllm_dtype="fp8"), "vllm_dtype='fp8'"),
        (dict(use_vllm=True, vllm_mode="server", vllm_dtype="float32"), "vllm_dtype applies to vllm_mode=colocate"),
        (dict(vllm_request_timeout_s=0), r"vllm_request_timeout_s=0 must be > 0"),
        # 4 rows per rank, 2 groups of 2 would break groups across ranks
        (dict(num_generations=3), "divisible|multiple of num_generations"),
        # 8 rows = 2 groups of 4; APPO keeps 2 x 1 = 2 rows which cannot split into 4 micro-batches
        (
            dict(rollout_strategy="appo", initial_rollouts=1, per_device_train_batch_size=2, steps_per_generation=4),
            "split evenly",
        ),
    ],
)
def test_invalid_combinations_fail_with_a_clear_message(kw, message):
    with pytest.raises(ValueError, match=message):
        make(**kw)


def test_colocate_mode_is_accepted():
    cfg = make(use_vllm=True, vllm_mode="colocate", vllm_dtype="float32")
    assert (cfg.vllm_mode, cfg.vllm_dtype) == ("colocate", "float32")


def test_colocate_with_tensor_parallelism_is_refused_naming_server_mode():
    """TRL's TP colocate runs one engine per rank in lockstep (`external_launcher`): every rank of a TP group must
    issue the same requests, while each rank's tool loop sends its own. Refused in one line; server mode serves TP."""
    message = "^APPOConfig: vllm_mode=colocate with vllm_tensor_parallel_size=2 is not supported .*vllm_mode=server"
    with pytest.raises(ValueError, match=message + " \\(`vllm serve MODEL --tensor-parallel-size 2`\\)\\.$"):
        make(use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=2)
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size=2"):  # a converted GRPOConfig too
        from appo_trl.trainer.trl_compat import grpo_to_appo

        grpo_to_appo(GRPOConfig(**BASE, use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=2))
    assert make(use_vllm=True, vllm_mode="server", vllm_tensor_parallel_size=2).vllm_tensor_parallel_size == 2
    assert make(use_vllm=False, vllm_mode="colocate", vllm_tensor_parallel_size=2).use_vllm is False


def test_appo_batch_that_splits_evenly_is_accepted():
    cfg = make(rollout_strategy="appo", initial_rollouts=2, per_device_train_batch_size=2, steps_per_generation=4)
    assert cfg.per_device_train_batch_size * cfg.steps_per_generation // 4 * 2 % 4 == 0
