"""LoRA RL (`peft_config`, `use_peft: true`) trains on every route: the four strategies, the in-process sampler (with
and without background rounds), the vLLM server with the adapter-only sync (background rounds, several replicas
behind the router, the NCCL route's servers) and an agent through the endpoint. Only adapter weights move, and
the reference model is the base model with the adapter disabled (no second copy), as TRL does it."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from peft import LoraConfig

from appo_trl.config import APPOConfig
from appo_trl.trainer.trainer import APPOTrainer
from tests.trainer.test_trainer import CPU, RewardSpy, dataset, spy_loss
from tests.trainer.test_trainer_engine import real_engine

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
fake_vllm = pytest.importorskip("bench.fake_vllm")


def lora(**kw):
    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM", **kw)


def peft_trainer(tmp_path, tok, path, engine=None, peft_config=None, train_dataset=None, **kw):
    args = APPOConfig(output_dir=str(tmp_path / "out"), **{**CPU, "max_steps": 1, **kw})
    return APPOTrainer(model=path, reward_funcs=[RewardSpy()], args=args, processing_class=tok,
                       train_dataset=train_dataset or dataset(), rollout_engine=engine,
                       peft_config=peft_config or lora())  # fmt: skip


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def assert_only_the_adapter_moved(trainer, before) -> None:
    moved = {k for k, v in trainer.model.named_parameters() if not torch.equal(before[k], v)}
    assert moved and all("lora_" in k for k in moved), sorted(moved)[:5]


def logps(model, ids, mask, width):
    """Per-token logps of the last `width` ids (temperature 1), as TRL's forward computes them."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -width - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -width:, None]).squeeze(-1)


STRATEGY_KW = {
    "grpo": {},
    "arpo": dict(initial_rollouts=2, branch_probability=1.0, beam_size=2),
    "aepo": dict(initial_rollouts=2, branch_probability=0.0, beam_size=2, dynamic_rollouts=True,
                 dynamic_rollouts_source="reuse"),
    "appo": dict(initial_rollouts=2, min_remaining_tokens=2),
}  # fmt: skip


@pytest.mark.parametrize("strategy", ["grpo", "arpo", "aepo", "appo"])
def test_each_strategy_trains_the_adapter_against_the_base_as_reference(
    tmp_path, tiny_tokenizer, tiny_model_path, strategy
):
    from transformers import AutoModelForCausalLM

    engine = real_engine(tiny_tokenizer, hook_mode="lookahead", record_entropies=True, entropy_topk=2)
    # a non-zero adapter from the start: the policy differs from the base before the first step
    trainer = peft_trainer(tmp_path, tiny_tokenizer, tiny_model_path, engine, peft_config=lora(init_lora_weights=False),
                           tools=["python"], rollout_strategy=strategy, num_generations=4,
                           per_device_train_batch_size=4, max_completion_length=96, beta=0.04,
                           **STRATEGY_KW[strategy])  # fmt: skip
    assert trainer.ref_model is None  # TRL: the reference is the policy with its adapter disabled
    seen, before = spy_loss(trainer), params(trainer.model)
    trainer.train()
    engine.close()
    assert_only_the_adapter_moved(trainer, before)
    assert any("kl" in h for h in trainer.state.log_history)
    # the reference logps are the base model's, exactly: a fresh copy of the base, TRL's own forward
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    inputs = seen[0]
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    width = inputs["completion_ids"].size(1)
    ref, policy = logps(base, ids, mask, width), logps(trainer.model, ids, mask, width)
    keep = inputs["completion_mask"].bool()
    assert torch.allclose(inputs["ref_per_token_logps"][keep], ref[keep], atol=1e-5)
    assert (policy[keep] - ref[keep]).abs().max() > 1e-3  # the adapter changes the logps: a real comparison


def test_in_process_sampler_with_and_without_background_rounds(tmp_path, tiny_tokenizer, tiny_model_path):
    kw = dict(tools=["python"], num_generations=4, per_device_train_batch_size=4, max_completion_length=12)
    trainer = peft_trainer(tmp_path, tiny_tokenizer, tiny_model_path, **kw)
    before = params(trainer.model)
    trainer.train()
    assert (
        not trainer.sampling_path.trl_sampler and trainer.rollout_engine.backend.model is trainer.model
    )  # our engine, PEFT
    assert_only_the_adapter_moved(trainer, before)

    trainer = peft_trainer(tmp_path, tiny_tokenizer, tiny_model_path, max_steps=3, max_staleness=1, **kw)
    sampler = trainer.rounds.sampler.model
    assert sampler is not trainer.model and hasattr(sampler, "peft_config")  # the copy keeps the adapter
    before = params(trainer.model)
    trainer.train()
    assert_only_the_adapter_moved(trainer, before)
    assert trainer.rounds.async_rounds.num_syncs >= 2
    synced = dict(sampler.named_parameters())  # synced at the last hand-over: the policy of that step
    assert all(k in synced for k in before)


def answer_policy(tokenizer):
    eos = tokenizer.eos_token_id
    answer = tokenizer.encode("<answer> 4 </answer>", add_special_tokens=False) + [eos]
    return fake_vllm.ScriptedPolicy(tokenizer, lambda ctx, rng: answer[:1] * rng.randint(0, 8) + answer)


SERVER_KW = dict(use_vllm=True, vllm_mode="server", num_generations=4, per_device_train_batch_size=4,
                 max_completion_length=16, vllm_importance_sampling_correction=False)  # fmt: skip


def test_background_rounds_name_the_version_they_were_launched_on(tmp_path, tiny_tokenizer, tiny_model_path):
    with fake_vllm.FakeVLLMServer(answer_policy(tiny_tokenizer), tiny_tokenizer, max_lora_rank=8) as server:
        kw = {**SERVER_KW, "vllm_importance_sampling_correction": True}  # max_staleness >= 1 needs it
        trainer = peft_trainer(tmp_path, tiny_tokenizer, tiny_model_path, max_steps=4, max_staleness=1,
                               vllm_server_base_url=server.url, **kw)  # fmt: skip
        assert trainer.vllm_server.weight_sync == "adapter"
        before = params(trainer.model)
        trainer.train()
        trainer.rollout_engine.close()
    assert_only_the_adapter_moved(trainer, before)
    events = [e for e in server.events if e != "reset_prefix_cache"]
    # each round's requests name one version, loaded before them and unloaded only after them
    current, alive, named = None, set(), []
    for event, model in zip(events, _models(server, events)):
        if event.startswith("load:"):
            current = event[5:]
            alive.add(current)
        elif event.startswith("unload:"):
            assert event[7:] != current
            alive.discard(event[7:])
        else:
            assert model == current and model in alive
            named.append(model)
    rounds = [named[i : i + 4] for i in range(0, len(named), 4)]
    assert len(rounds) == 4 and all(len(set(r)) == 1 for r in rounds)
    assert len(set(named)) >= 2 and list(server.adapters) == [current]


def _models(server, events):
    bodies = iter(server.bodies)
    return [next(bodies)["model"] if e == "completion" else None for e in events]


def test_hold_keeps_a_version_loaded_and_named_until_its_round_ends(tmp_path, tiny_tokenizer, tiny_model_path):
    from accelerate import Accelerator
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from appo_trl.vllm.weight_sync import DiskWeightSync

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), lora())
    with fake_vllm.FakeVLLMServer(answer_policy(tiny_tokenizer), tiny_tokenizer, max_lora_rank=8) as server:
        sync = DiskWeightSync(model=model, accelerator=Accelerator(cpu=True), processing_class=tiny_tokenizer,
                              mode="server", server_base_url=server.url, adapter=True)  # fmt: skip
        versions = sync.adapters
        sync.sync_weights()
        v1 = versions.current
        with versions.hold() as name:  # a round in flight on v1 while v2 and v3 are published
            assert name == v1
            sync.sync_weights()
            sync.sync_weights()
            assert versions.request_model() == v1 and versions.current == versions.name_for(3)
            assert set(server.adapters) == {v1, versions.name_for(3)}  # v2 (never held) unloaded, v1 kept
        assert versions.request_model() == versions.name_for(3)
        sync.sync_weights()
        assert set(server.adapters) == {versions.name_for(4)}  # v1 released: unloaded at the next sync


def test_nccl_route_servers_with_lora_get_the_adapter_over_http(tmp_path, tiny_tokenizer, tiny_model_path):
    with fake_vllm.FakeVLLMServer(answer_policy(tiny_tokenizer), tiny_tokenizer, max_lora_rank=8) as server:
        trainer = peft_trainer(tmp_path, tiny_tokenizer, tiny_model_path, vllm_server_base_url=server.url,
                               vllm_weight_sync="nccl", **SERVER_KW)  # fmt: skip
        assert trainer.vllm_server.weight_sync == "adapter"  # no NCCL communicator (no CUDA needed)
        trainer.train()
        trainer.rollout_engine.close()
    assert [e.split(":")[0] for e in server.events] == ["load"] + ["completion"] * 4


def test_two_replicas_behind_the_router_each_load_every_version(tmp_path, tiny_tokenizer, tiny_model_path):
    from appo_trl.vllm.router import RouterError, router_executable

    try:
        router_executable()
    except RouterError:
        pytest.skip("vllm-router is not installed (pip install '.[router]')")
    servers = [fake_vllm.FakeVLLMServer(answer_policy(tiny_tokenizer), tiny_tokenizer, max_lora_rank=8).start()
               for _ in range(2)]  # fmt: skip
    try:
        trainer = peft_trainer(tmp_path, tiny_tokenizer, tiny_model_path, max_steps=2,
                               vllm_server_base_url=[s.url for s in servers], **SERVER_KW)  # fmt: skip
        trainer.train()
        trainer.rollout_engine.close()
        trainer.vllm_server.replicas.close()
    finally:
        for s in servers:
            s.stop()
    names = [trainer.vllm_generation.adapters.name_for(v) for v in (1, 2)]
    for s in servers:
        assert [e for e in s.events if ":" in e] == [f"load:{names[0]}", f"load:{names[1]}", f"unload:{names[0]}"]
    assert sorted(b["model"] for s in servers for b in s.bodies) == sorted(names * 4)


def test_an_agent_through_the_endpoint_trains_the_adapter(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path):
    from tests.trainer.test_agents import ScriptedBackend, prompts, sdk_agent

    pytest.importorskip("openai")
    args = APPOConfig(output_dir=str(tmp_path), **CPU, num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=96, max_steps=2)  # fmt: skip
    trainer = APPOTrainer(model=tiny_chat_model_path, reward_funcs=None, processing_class=tiny_chat_tokenizer,
                          args=args, train_dataset=prompts(), agent=sdk_agent, peft_config=lora())  # fmt: skip
    trainer.rollout_engine.backend = ScriptedBackend(tiny_chat_tokenizer)
    before = params(trainer.model)
    trainer.train()
    assert trainer.state.global_step == 2
    assert_only_the_adapter_moved(trainer, before)
