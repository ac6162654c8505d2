"""`rollout_stream: true` on the in-process sampler copy (`use_vllm: false`): groups stream on a copy of the
policy whose weights are swapped between two decode steps at every hand-over (`InProcessSync`, `DecodeGate`); each
token carries its version, the staleness bound holds per token, and TRL's behaviour-policy correction runs on the
copy's logprobs. tests/rollout/test_decode_gate.py checks the logprobs across a swap against transformers."""

from __future__ import annotations

import pytest
import torch

from appo_trl.trainer.inflight_sync import InProcessSync
from tests.trainer.test_trainer import make_trainer

STREAM = dict(use_vllm=False, num_generations=2, per_device_train_batch_size=4, max_completion_length=24,
              max_staleness=2, rollout_stream=True, stream_overprovision=0.5, learning_rate=1e-3)  # fmt: skip


def length_reward(completions, **_) -> list[float]:
    return [len(str(c)) / 10.0 for c in completions]  # varied: non-zero advantages, the policy moves


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_groups_stream_on_the_sampler_copy_and_its_weights_swap_in_flight(tmp_path, tiny_tokenizer, tiny_model_path,
                                                                          mode):  # fmt: skip
    trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, None, length_reward, max_steps=4,
                           inflight_update=mode, dump_rollouts=2, **STREAM)  # fmt: skip
    stream = trainer.rounds.stream
    assert isinstance(stream.sync, InProcessSync) and trainer.rounds.async_rounds is None
    backend = trainer.rounds.engine.backend
    assert backend.model is stream.sampler.model is not trainer.model and backend.gate is stream.gate
    handed, synced = [], []
    take, sync = stream.take_round, stream.sync.sync

    def record_sync(version):
        out = sync(version)  # the copy holds the policy's weights of `version` from here on
        copy_ = dict(stream.sampler.model.named_parameters())
        synced.append(all(torch.equal(p, copy_[n]) for n, p in trainer.model.named_parameters()))
        return out

    stream.take_round = lambda prompts: handed.append(take(prompts)) or handed[-1]
    stream.sync.sync = record_sync
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 4 and len(handed) == 4 and synced == [True] * 4
    assert stream.clock.version == 3 and len(stream.sync.pause_s) == 4 and stream.gate.swaps == 4
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # it trained
    for step, (rnd, oldest) in enumerate(handed):
        assert len(rnd.groups) == 2 and all(len(g) == 2 for g in rnd.groups)
        for row in rnd.rows:
            assert row.versions is not None and len(row.versions) == len(row.completion_ids)
            assert max(row.versions) <= step and step - row.oldest_version() <= 2  # the bound, per token
        assert oldest == min(r.oldest_version() for r in rnd.rows)
    logs = [h for h in trainer.state.log_history if "rollout/stream/pause_s" in h]
    assert len(logs) == 4
    # TRL's correction ran on the copy's logprobs; at step 0 the copy is the policy (the same weights, one forward)
    assert all("sampling/sampling_logp_difference/max" in h for h in logs)
    assert logs[0]["sampling/sampling_logp_difference/max"] < 1e-4 and logs[0]["rollout/staleness/token_max"] == 0


def test_colocate_and_sharding_are_refused_in_one_line(tmp_path):
    from appo_trl.config import APPOConfig

    with pytest.raises(ValueError, match="rollout_stream: true with vllm_mode=colocate"):
        APPOConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, vllm_mode="colocate", max_staleness=1,
                   rollout_stream=True)  # fmt: skip
