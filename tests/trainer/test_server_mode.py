"""Server mode: `use_vllm=True, vllm_mode="server"` samples through our HTTP backend against the fake vLLM
server (bench/fake_vllm.py), and weights are synced through TRL's `VLLMGeneration` exactly once per round.

TRL's `VLLMGeneration` needs CUDA/NCCL for the real weight transfer, so it is replaced by a recorder here.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.trainer.test_trainer import RewardSpy, make_trainer, spy_loss

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
fake_vllm = pytest.importorskip("bench.fake_vllm")


class _ServerInfo:
    def get_server_info(self):
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}


class RecordingVLLMGeneration:
    instances = []

    def __init__(self, **kwargs):
        self.kwargs, self.syncs, self.vllm_client = kwargs, 0, _ServerInfo()
        RecordingVLLMGeneration.instances.append(self)

    def sync_weights(self):
        self.syncs += 1


def test_server_mode_generates_over_http_and_syncs_once_per_round(
    tmp_path, tiny_tokenizer, tiny_model_path, monkeypatch
):
    import trl.trainer.grpo_trainer as grpo_mod

    monkeypatch.setattr(grpo_mod, "VLLMGeneration", RecordingVLLMGeneration)
    eos = tiny_tokenizer.eos_token_id
    answer = tiny_tokenizer.encode("<answer> 4 </answer>", add_special_tokens=False) + [eos]
    policy = fake_vllm.ScriptedPolicy(tiny_tokenizer, lambda ctx, rng: answer)
    with fake_vllm.FakeVLLMServer(policy, tiny_tokenizer, max_num_seqs=4) as server:
        reward = RewardSpy()
        trainer = make_trainer(
            tmp_path,
            tiny_tokenizer,
            tiny_model_path,
            None,
            reward,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_url=server.url,
            num_generations=4,
            per_device_train_batch_size=4,
            max_steps=2,
            max_completion_length=16,
        )
        generate_calls = []
        orig = trainer._generate
        trainer._generate = lambda prompts: generate_calls.append(len(prompts)) or orig(prompts)
        seen = spy_loss(trainer)
        trainer.train()
        trainer.rollout_engine.close()
    assert len(policy.requests) == 8  # 2 rounds x 4 rows over HTTP
    assert generate_calls == [4, 4]
    assert RecordingVLLMGeneration.instances[-1].syncs == 2  # once per round
    assert all(
        t.endswith("<answer> 4 </answer>") or "<answer> 4 </answer>" in t for c in reward.calls for t in c["texts"]
    )
    assert all("sampling_per_token_logps" in s or "importance_sampling_ratio" in s for s in seen)
