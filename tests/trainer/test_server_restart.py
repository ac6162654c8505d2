"""A vLLM server restart during training: the run waits for it, syncs the weights again, and goes on.

Before: generation gave up after about 3.5 s of retries and the weight sync was never retried, so a server
restart killed the run. The fake server (bench/fake_vllm.py) restarts on the same port, with its events marked:
R = reload_weights, C = reset_prefix_cache, g = a completion served, d = the request that made it die,
X = the restart (port closed, then open again).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

import pytest
import torch
from transformers import TrainerCallback

from tests.trainer.test_server_mode import RecordingVLLMGeneration
from tests.trainer.test_trainer import RewardSpy, make_trainer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
fake_vllm = pytest.importorskip("bench.fake_vllm")

pytestmark = pytest.mark.timeout(300)

LETTERS = {"rpc:reload_weights": "R", "reset_prefix_cache": "C", "completion": "g", "dying": "d", "restart": "X"}


def assert_rerun_with_the_same_seeds(first: list[dict], rerun: list[dict]) -> None:
    """The rerun round asks for the dead round's seeds: each seed the dead round sent (the requests that reached the
    server before it died, and retries of them after it came back) is among the rerun's 4 distinct seeds."""
    seen, again = {b["seed"] for b in first}, [b["seed"] for b in rerun]
    assert len(again) == len(set(again)) == 4, again
    assert len(seen) >= 2 and seen <= set(again), (seen, again)


def _policy(tok):
    answer = tok.encode("<answer> 4 </answer>", add_special_tokens=False) + [tok.eos_token_id]
    return fake_vllm.ScriptedPolicy(tok, lambda ctx, rng: answer[:1] * rng.randint(0, 8) + answer)


def _trainer(tmp_path, tok, model_path, server, **kw):
    return make_trainer(tmp_path, tok, model_path, None, RewardSpy(), use_vllm=True, vllm_mode="server",
                        vllm_server_base_url=server.url, num_generations=4, per_device_train_batch_size=4,
                        max_steps=2, max_completion_length=16, vllm_importance_sampling_correction=False,
                        vllm_server_wait_s=60, **kw)  # fmt: skip


def _record_synced_weights(trainer, server):
    from safetensors.torch import load_file

    weights, orig = [], trainer.vllm_generation.sync_weights

    def record():
        orig()
        weights.append(load_file(os.path.join(server.rpc_calls[-1]["kwargs"]["weights_path"], "model.safetensors")))

    trainer.vllm_generation.sync_weights = record
    return weights


def test_a_restart_mid_round_resyncs_and_reruns_the_round(tmp_path, tiny_tokenizer, tiny_model_path):
    policy = _policy(tiny_tokenizer)
    with fake_vllm.FakeVLLMServer(policy, tiny_tokenizer, max_model_len=1024, restart_at=6) as server:
        trainer = _trainer(tmp_path, tiny_tokenizer, tiny_model_path, server)
        weights = _record_synced_weights(trainer, server)
        trainer.train()
        server.restarter.join()
    events = "".join(LETTERS[e] for e in server.events)
    assert re.fullmatch(r"RCggggRCg*dg*Xg*RCgggg", events), events  # after X: sync, cache reset, then the round
    assert trainer.state.global_step == 2
    assert len(weights) == 3  # round 1, round 2, round 2 again after the restart: the same step's weights
    assert all(torch.equal(weights[1][k], weights[2][k]) for k in weights[1])
    assert not all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    _, _, first, rerun = server.bodies_per_sync()
    assert_rerun_with_the_same_seeds(first, rerun)


def test_a_restart_between_rounds_is_waited_for_by_the_sync(tmp_path, tiny_tokenizer, tiny_model_path):
    policy = _policy(tiny_tokenizer)
    with fake_vllm.FakeVLLMServer(policy, tiny_tokenizer, max_model_len=1024) as server:
        trainer = _trainer(tmp_path, tiny_tokenizer, tiny_model_path, server)
        threads = []

        class RestartAfterStep1(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                if state.global_step == 1:
                    threads.append(threading.Thread(target=server.restart, args=(2.0,), daemon=True))
                    threads[0].start()
                    time.sleep(0.3)  # the port is closed when round 2 starts its sync

        trainer.add_callback(RestartAfterStep1())
        trainer.train()
        threads[0].join()
    assert "".join(LETTERS[e] for e in server.events) == "RCggggXRCgggg"
    assert trainer.state.global_step == 2


def test_nccl_route_restart_is_one_clear_error(tmp_path, tiny_tokenizer, tiny_model_path, monkeypatch):
    import trl.trainer.grpo_trainer as grpo_mod

    from appo_trl.vllm.server import VLLMServerError

    monkeypatch.setattr(grpo_mod, "VLLMGeneration", RecordingVLLMGeneration)
    policy = _policy(tiny_tokenizer)
    with fake_vllm.FakeVLLMServer(policy, tiny_tokenizer, max_model_len=1024, restart_at=1) as server:
        trainer = _trainer(tmp_path, tiny_tokenizer, tiny_model_path, server, vllm_weight_sync="nccl")
        with pytest.raises(VLLMServerError, match="NCCL weight sync cannot re-attach to a new server process"):
            trainer.train()
        server.restarter.join()


def test_a_server_that_accepts_and_goes_silent_fails_the_run_naming_the_timeout(
    tmp_path, tiny_tokenizer, tiny_model_path
):
    """A server that accepts every completion request and never answers (hung, or a half-open connection) is not a
    hang: each request times out after `vllm_request_timeout_s`, is retried 3 times, and the run fails naming it."""
    from appo_trl.vllm.server import VLLMServerError

    with fake_vllm.FakeVLLMServer(_policy(tiny_tokenizer), tiny_tokenizer, max_model_len=1024) as server:
        trainer = _trainer(tmp_path, tiny_tokenizer, tiny_model_path, server, vllm_request_timeout_s=0.3)
        assert trainer.rollout_engine.backend.timeout_s == 0.3
        server.extra_delay_s = 3600.0
        start = time.monotonic()
        with pytest.raises(VLLMServerError, match=r"failed after 4 attempts: timed out: no answer within "
                           r"vllm_request_timeout_s=0.3 s \(ReadTimeout\)"):  # fmt: skip
            trainer.train()
        assert time.monotonic() - start < 60
        server.extra_delay_s = 0.0


def test_a_server_that_dies_after_a_checkpoint_is_one_line_naming_it(tmp_path, tiny_tokenizer, tiny_model_path, capfd):
    """The server dies for good after step 1 (checkpoint-1 saved): one line with the server's error and the kept
    checkpoint with how to resume, exit code 1, no traceback (as Ctrl-C and SIGTERM)."""
    from appo_trl.stages.interrupts import run_interruptible

    class KillAfterStep1(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            server.kill()

    with fake_vllm.FakeVLLMServer(_policy(tiny_tokenizer), tiny_tokenizer, max_model_len=1024) as server:
        trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(), use_vllm=True,
                               vllm_mode="server", vllm_server_base_url=server.url, num_generations=4,
                               per_device_train_batch_size=4, max_steps=3, max_completion_length=16,
                               vllm_importance_sampling_correction=False, vllm_server_wait_s=0,
                               vllm_request_timeout_s=1.0, save_strategy="steps", save_steps=1)  # fmt: skip
        trainer.add_callback(KillAfterStep1())
        capfd.readouterr()
        assert run_interruptible("appo train", str(tmp_path), trainer.train) == 1
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("appo train")]
    assert len(err) == 1 and "Traceback" not in capfd.readouterr().err
    assert "appo train: error: " in err[0] and "vLLM server" in err[0]
    assert f"kept {tmp_path / 'checkpoint-1'} (continue with --resume_from_checkpoint true)" in err[0]
