"""`max_staleness >= 1` through the trainer: background rounds run, fail, stop and resume as they should.

Pinned: `max_staleness: 0` builds none of it; in-process rounds run on the round thread with the behaviour
correction, and the real backend decodes with the sampler copy, synced to the policy; torch's thread count is split
from the user's and restored; a background fault reaches the trainer within one step; Ctrl-C joins the round
thread; a resumed run discards the round in flight and trains every generation batch exactly once; in vLLM server
mode no weight sync lands while a request decodes and a server restart in the first round is survived; ARPO and
AEPO run in the background unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import pytest
import torch
from transformers import TrainerCallback

from appo_trl.trainer.async_rounds import (
    BackgroundRoundError,
    sampler_threads,
)
from tests.trainer.async_helpers import GRPO, _weights
from tests.trainer.fakes import ScriptedEngine
from tests.trainer.test_server_restart import assert_rerun_with_the_same_seeds
from tests.trainer.test_trainer import RewardSpy, make_trainer


# ---- through the trainer --------------------------------------------------------------------------------------
class ThreadEngine(ScriptedEngine):
    """Scripted engine that records the thread and prompts of each round, with an optional delay or failure."""

    def __init__(self, tok, delay=0.0, fail_call=None):
        super().__init__(tok)
        self.threads, self.prompts, self.delay, self.fail_call = [], [], delay, fail_call

    async def rollout(self, prompts, n, **kw):
        self.threads.append(threading.current_thread().name)
        self.prompts.append([list(p) for p in prompts])
        if self.fail_call is not None and len(self.threads) == self.fail_call:
            raise RuntimeError("search server down (HTTP 503)")
        if self.delay:
            await asyncio.sleep(self.delay)
        return await super().rollout(prompts, n, **kw)


def test_max_staleness_zero_builds_nothing(tmp_path, tiny_tokenizer, tiny_model_path):
    engine = ThreadEngine(tiny_tokenizer)
    trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, engine, RewardSpy(), max_steps=2, **GRPO)
    assert trainer.rounds.async_rounds is None and trainer.rounds.sampler is None
    trainer.train()
    assert engine.threads == ["MainThread", "MainThread"]
    assert not any("rollout/staleness/mean" in e for e in trainer.state.log_history)


def test_background_rounds_in_process(tmp_path, tiny_tokenizer, tiny_model_path):
    engine = ThreadEngine(tiny_tokenizer)
    trainer = make_trainer(
        tmp_path, tiny_tokenizer, tiny_model_path, engine, RewardSpy(), max_steps=4, max_staleness=1,
        vllm_importance_sampling_mode="token_truncate", **GRPO,
    )  # fmt: skip
    assert trainer.rounds.sampler is not None and trainer.rounds.sampler.model is not trainer.model
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    hist = trainer.rounds.async_rounds.history
    assert [(h.step, h.version, h.staleness, h.background) for h in hist] == [
        (0, 0, 0, False), (1, 0, 1, True), (2, 1, 1, True), (3, 2, 1, True)
    ]  # fmt: skip
    assert engine.threads == ["MainThread", "appo-round-0", "appo-round-1", "appo-round-2"]
    assert trainer.rounds.async_rounds.num_syncs == 3  # steps 0, 1, 2; nothing is launched after the last hand-over
    logs = [e for e in trainer.state.log_history if "rollout/staleness/max" in e]
    assert [e["rollout/staleness/max"] for e in logs] == [0.0, 1.0, 1.0, 1.0]
    assert all("sampling/importance_sampling_ratio/mean" in e for e in logs)  # the behaviour correction ran
    # the sampler copy holds the weights of its last sync (step 2), not the final policy
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    sampler = trainer.rounds.sampler.model.state_dict()
    assert any(not torch.equal(sampler[k], after[k]) for k in after)


def test_an_epoch_of_one_generation_batch_says_its_rounds_stay_synchronous(tmp_path, tiny_tokenizer, tiny_model_path,
                                                                           caplog):  # fmt: skip
    from appo_trl.config import APPOConfig
    from appo_trl.trainer.trainer import APPOTrainer
    from tests.trainer.test_trainer import CPU, dataset

    args = APPOConfig(output_dir=str(tmp_path), **{**CPU, **GRPO, "max_steps": 3, "max_staleness": 1})
    engine = ThreadEngine(tiny_tokenizer)
    trainer = APPOTrainer(model=tiny_model_path, reward_funcs=[RewardSpy()], args=args, train_dataset=dataset(1),
                          processing_class=tiny_tokenizer, rollout_engine=engine)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="appo_trl.trainer.async_rounds"):
        trainer.train()
    assert [h.background for h in trainer.rounds.async_rounds.history] == [False, False, False]
    said = [r.getMessage() for r in caplog.records if "one generation batch" in r.getMessage()]
    assert len(said) == 1 and "max_staleness=1" in said[0] and "every round runs synchronously" in said[0]


def test_the_in_process_backend_decodes_on_the_synced_sampler_copy(tmp_path, tiny_tokenizer, tiny_model_path):
    """The real `TransformersBackend` (no injected engine): it decodes with the sampler copy, and after training
    the copy holds exactly the policy's weights of the last sync (step 1 of 3), not the initial ones."""
    trainer = make_trainer(
        tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(), tools=["python"], num_generations=4,
        per_device_train_batch_size=4, max_completion_length=24, max_steps=3, max_staleness=1,
        vllm_importance_sampling_mode="token_truncate",
    )  # fmt: skip
    backend = trainer.rollout_engine.backend
    assert type(backend).__name__ == "TransformersBackend"
    assert backend.model is trainer.rounds.sampler.model and backend.model is not trainer.model
    initial = _weights(trainer.model)
    synced = {}  # global step -> the policy's weights when the sampler was synced
    real_sync_fn = trainer.rounds.async_rounds.sync_fn

    def sync_fn():
        synced[trainer.state.global_step] = _weights(trainer.model)
        real_sync_fn()

    trainer.rounds.async_rounds.sync_fn = sync_fn
    trainer.train()
    assert [(h.step, h.version, h.background) for h in trainer.rounds.async_rounds.history] == [
        (0, 0, False), (1, 0, True), (2, 1, True)
    ]  # fmt: skip
    assert sorted(synced) == [0, 1]
    sampler, last, final = _weights(trainer.rounds.sampler.model), synced[1], _weights(trainer.model)
    assert all(torch.equal(sampler[k], last[k]) for k in last), "the sampler copy is not the policy of step 1"
    assert any(not torch.equal(sampler[k], initial[k]) for k in initial), "the sampler copy was never synced"
    assert any(not torch.equal(sampler[k], final[k]) for k in final)  # the policy trained on after the last sync


@pytest.mark.parametrize("cores, current, each", [(8, 2, 1), (8, 16, 4), (4, 6, 2), (16, 1, 1), (1, 4, 1)])
def test_sampler_threads_halve_the_users_budget(monkeypatch, cores, current, each):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert sampler_threads(current) == each


class ThreadCount(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_step_begin(self, args, state, control, **kw):
        self.seen.append(torch.get_num_threads())


def test_train_splits_the_users_thread_count_and_restores_it(tmp_path, tiny_tokenizer, tiny_model_path, monkeypatch):
    """8 usable cores, but the user asked torch for 2 threads: each side gets 1 while `train()` runs (not half the
    cores, 4), the count is left alone before `train()`, and it is 2 again after `train()`, even after a failure."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    original = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = ThreadEngine(tiny_tokenizer)
        trainer = make_trainer(
            tmp_path, tiny_tokenizer, tiny_model_path, engine, RewardSpy(), max_steps=2, max_staleness=1, **GRPO
        )
        assert torch.get_num_threads() == 2  # building the trainer changes nothing
        spy = ThreadCount()
        trainer.add_callback(spy)
        sampled = []
        real_rollout = engine.rollout

        async def rollout(*a, **k):
            sampled.append((threading.current_thread().name, torch.get_num_threads()))
            return await real_rollout(*a, **k)

        engine.rollout = rollout
        trainer.train()
        assert spy.seen == [1, 1] and sampled == [("MainThread", 1), ("appo-round-0", 1)]
        assert torch.get_num_threads() == 2
        engine.fail_call = len(engine.threads) + 1  # the next run's first round fails: restored all the same
        with pytest.raises(RuntimeError, match="search server down"):
            trainer.train()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(original)


def test_a_background_fault_reaches_the_trainer_within_one_step(tmp_path, tiny_tokenizer, tiny_model_path):
    engine = ThreadEngine(tiny_tokenizer, fail_call=2)  # the first background round
    trainer = make_trainer(
        tmp_path, tiny_tokenizer, tiny_model_path, engine, RewardSpy(), max_steps=4, max_staleness=1, **GRPO
    )
    with pytest.raises(BackgroundRoundError, match="search server down") as e:
        trainer.train()
    assert isinstance(e.value.__cause__, RuntimeError)
    assert trainer.state.global_step == 1  # raised at the hand-over of the failed round's own step


class InterruptAt(TrainerCallback):
    def __init__(self, step, hook="on_step_end"):
        self.step = step
        setattr(self, hook, self._maybe)

    def _maybe(self, args, state, control, **kw):
        if state.global_step == self.step:
            raise KeyboardInterrupt


def test_ctrl_c_stops_both_sides(tmp_path, tiny_tokenizer, tiny_model_path):
    engine = ThreadEngine(tiny_tokenizer, delay=1.0)  # the background round is still sampling at Ctrl-C
    trainer = make_trainer(
        tmp_path, tiny_tokenizer, tiny_model_path, engine, RewardSpy(), max_steps=4, max_staleness=1, **GRPO
    )
    trainer.add_callback(InterruptAt(1))
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    thread = trainer.rounds.async_rounds.last_thread
    assert thread is not None and not thread.is_alive() and trainer.rounds.async_rounds.closed
    assert trainer.rounds.async_rounds.pending is None and time.monotonic() - t0 < 20


def trained_prompts(trainer):
    """The prompt ids of the rows each round hands to the trainer (from the sampled trajectories themselves)."""
    rounds = []
    orig = trainer._generate

    def spy(prompts):
        out = orig(prompts)
        rounds.append(sorted({tuple(p) for p in out[0]}))
        return out

    trainer._generate = spy
    return rounds


def test_resume_discards_the_round_in_flight(tmp_path, tiny_tokenizer, tiny_model_path):
    kw = dict(max_steps=3, max_staleness=1, save_strategy="steps", save_steps=1, **GRPO)
    reference = make_trainer(
        tmp_path / "ref", tiny_tokenizer, tiny_model_path, ThreadEngine(tiny_tokenizer), RewardSpy(), **kw
    )
    ref = trained_prompts(reference)
    reference.train()

    engine = ThreadEngine(tiny_tokenizer)
    trainer = make_trainer(tmp_path / "run", tiny_tokenizer, tiny_model_path, engine, RewardSpy(), **kw)
    first = trained_prompts(trainer)
    trainer.add_callback(InterruptAt(2, hook="on_save"))  # checkpoint-2 is on disk, round 3 is in flight
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert [h.step for h in trainer.rounds.async_rounds.history] == [0, 1] and len(engine.prompts) == 3

    resumed = make_trainer(
        tmp_path / "run", tiny_tokenizer, tiny_model_path, ThreadEngine(tiny_tokenizer), RewardSpy(), **kw
    )
    second = trained_prompts(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    hist = resumed.rounds.async_rounds.history
    assert [(h.step, h.staleness, h.background) for h in hist] == [(2, 0, False)]  # regenerated on fresh weights
    assert len(set(map(tuple, ref))) == 3  # three distinct generation batches
    assert first + second == ref  # every generation batch trained exactly once, in order


def answering_fake_server(tokenizer):
    """`bench.fake_vllm` and a scripted policy that answers "4" after 0-7 filler tokens."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    fake_vllm = pytest.importorskip("bench.fake_vllm")
    answer = tokenizer.encode("<answer> 4 </answer>", add_special_tokens=False) + [tokenizer.eos_token_id]
    return fake_vllm, fake_vllm.ScriptedPolicy(tokenizer, lambda ctx, rng: answer[:1] * rng.randint(0, 8) + answer)


def test_a_weight_sync_never_lands_while_a_request_decodes(tmp_path, tiny_tokenizer, tiny_model_path):
    """vLLM server mode, disk route (CPU): every reload_weights reaches the server with no request in flight."""
    fake_vllm, policy = answering_fake_server(tiny_tokenizer)
    with fake_vllm.FakeVLLMServer(policy, tiny_tokenizer, max_model_len=1024, decode_step_s=0.1) as server:
        trainer = make_trainer(
            tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(), use_vllm=True, vllm_mode="server",
            vllm_server_base_url=server.url, num_generations=4, per_device_train_batch_size=4, max_steps=4,
            max_completion_length=16, max_staleness=1, vllm_importance_sampling_mode="token_truncate",
        )  # fmt: skip
        trainer.train()
    assert [c["method"] for c in server.rpc_calls] == ["reload_weights"] * 3  # steps 0, 1, 2
    assert server.rpc_in_flight == [0, 0, 0]
    assert [(h.staleness, h.background) for h in trainer.rounds.async_rounds.history] == [(0, False)] + [(1, True)] * 3
    assert trainer.vllm_generation.num_syncs == 3


def test_a_server_restart_in_a_synchronous_round_is_synced_and_rerun(tmp_path, tiny_tokenizer, tiny_model_path):
    """vLLM server mode: the first round of an async run is generated on the trainer's thread; a server restart
    during it (the 2nd completion request) is survived as in a synchronous run (`weight_sync.generate_round`): the
    weights are synced again and the round re-runs with the same seeds, then the next round runs in the background.
    R = reload_weights, C = reset_prefix_cache, g = a completion, d = the request that made it die, X = the restart."""
    import re

    fake_vllm, policy = answering_fake_server(tiny_tokenizer)
    with fake_vllm.FakeVLLMServer(policy, tiny_tokenizer, max_model_len=1024, restart_at=1) as server:
        trainer = make_trainer(
            tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(), use_vllm=True, vllm_mode="server",
            vllm_server_base_url=server.url, num_generations=4, per_device_train_batch_size=4, max_steps=2,
            max_completion_length=16, max_staleness=1, vllm_server_wait_s=60,
        )  # fmt: skip
        trainer.train()
        server.restarter.join()
    letters = {"rpc:reload_weights": "R", "reset_prefix_cache": "C", "completion": "g", "dying": "d", "restart": "X"}
    events = "".join(letters[e] for e in server.events)
    assert re.fullmatch(r"RCg*dg*Xg*RCgggggggg", events), events  # after X: sync, reset, the round, the next one
    assert [(h.step, h.background) for h in trainer.rounds.async_rounds.history] == [(0, False), (1, True)]
    assert trainer.state.global_step == 2
    _, first, rerun = server.bodies_per_sync()  # the 2nd sync's part also holds the background round
    assert_rerun_with_the_same_seeds(first, rerun[:4])


@pytest.mark.parametrize("strategy", ["arpo", "aepo"])
def test_arpo_and_aepo_run_in_the_background_unchanged(tmp_path, tiny_tokenizer, tiny_model_path, strategy):
    engine = ThreadEngine(tiny_tokenizer)
    trainer = make_trainer(
        tmp_path, tiny_tokenizer, tiny_model_path, engine, RewardSpy(), rollout_strategy=strategy,
        num_generations=4, initial_rollouts=2, per_device_train_batch_size=4, max_completion_length=64,
        tools=["python"], max_steps=3, max_staleness=1,
    )  # fmt: skip
    trainer.train()
    assert [(h.staleness, h.background) for h in trainer.rounds.async_rounds.history] == [
        (0, False),
        (1, True),
        (1, True),
    ]
    assert engine.threads == ["MainThread", "appo-round-0", "appo-round-1"]
    assert all(h is not None for h in engine.hooks)  # the in-loop branching hook rode along into the background
