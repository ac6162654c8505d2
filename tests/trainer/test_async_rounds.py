"""`max_staleness >= 1`: background rounds (appo_trl.trainer.async_rounds), their bound, correction and faults.

Pinned: the staleness of every handed round and the sync schedule for (k, weight_sync_steps) by hand; a stale
round is dropped and regenerated; a background exception reaches the trainer at the next hand-over with its
cause; the decoupled-PPO correction on a hand-computed two-token case, and TRL's four importance-sampling modes on
background rounds; Ctrl-C joins the round thread; a resumed run discards the round in flight and trains every
generation batch exactly once; APPO's selection forward never overlaps an optimizer step and reads the weights of
its hand-over (m = 2 too), and an evaluation between two hand-overs does not wait for it; APPO in the background is
refused under DeepSpeed / FSDP and vLLM colocate with any strategy; the real in-process backend decodes with the
sampler copy, synced to the policy; torch's thread count is split from the user's and restored; a server restart in
a round generated on the trainer's thread is survived; `max_staleness: 0` builds none of it.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from transformers import TrainerCallback

from appo_trl.trainer.async_rounds import (
    AsyncRounds,
    BackgroundRoundError,
    BatchLookahead,
    OptimizerStepLock,
    build_async_rounds,
    sampler_threads,
)
from appo_trl.trainer.config import APPOConfig
from tests.trainer.fakes import ScriptedEngine
from tests.trainer.test_server_restart import assert_rerun_with_the_same_seeds
from tests.trainer.test_trainer import CPU, RewardSpy, dataset, make_trainer


# ---- the scheduler alone --------------------------------------------------------------------------------------
@dataclass
class Round:
    rows: list


def drive(rounds: AsyncRounds, steps: int, rows: int = 4, fail_at: int | None = None):
    """Hand over one generation batch per optimizer step, as the trainer does (m = 1)."""
    batches = [[{"prompt": i}] for i in range(steps + 1)]
    it = iter(batches)
    made = []

    def make_job(inputs):
        def job():
            if inputs[0]["prompt"] == fail_at:
                raise ConnectionError("vLLM server at http://127.0.0.1:1 unreachable")
            return Round(rows=[inputs[0]["prompt"]] * rows)

        made.append(inputs[0]["prompt"])
        return job

    for step in range(steps):
        (batch,) = rounds.lookahead.pull(it, 1)
        rounds.next_round(batch, step, lambda b=batch: Round(rows=[b[0]["prompt"]] * rows), make_job)
    return made


@pytest.mark.parametrize(
    "k, w, staleness, syncs",
    [
        (1, 1, [0, 1, 1, 1, 1, 1], 5),  # sync at every hand-over but the last (nothing launched after it)
        (2, 1, [0, 1, 1, 1, 1, 1], 5),
        (2, 2, [0, 1, 2, 1, 2, 1], 3),  # syncs at steps 0, 2, 4: rows alternate 1 and 2 steps stale
        (3, 3, [0, 1, 2, 3, 1, 2], 2),  # syncs at steps 0 and 3
    ],
)
def test_staleness_and_sync_schedule_by_hand(k, w, staleness, syncs):
    synced = []
    rounds = AsyncRounds(k, w, 1, 1, sync_fn=lambda: synced.append(1), max_steps=6)
    drive(rounds, 6)
    assert [h.staleness for h in rounds.history] == staleness
    assert [h.background for h in rounds.history] == [False] + [True] * 5
    assert rounds.num_syncs == len(synced) == syncs
    assert max(h.staleness for h in rounds.history) <= k and rounds.dropped_rows == 0


def test_a_stale_round_is_dropped_and_regenerated():
    rounds = AsyncRounds(1, 1, 1, 1, sync_fn=lambda: None)
    it = iter([["a"], ["b"], ["c"]])
    (a,) = rounds.lookahead.pull(it, 1)
    rounds.next_round(a, 0, lambda: Round(rows=["a"] * 4), lambda inp: lambda: Round(rows=["bg"] * 4))
    (b,) = rounds.lookahead.pull(it, 1)
    regenerated = []
    # the trainer reached step 3 (not 1) before handing over b: its rows, sampled at step 0, are 3 steps stale
    out = rounds.next_round(b, 3, lambda: regenerated.append(1) or Round(rows=["fresh"] * 4), lambda i: None)
    assert out.rows == ["fresh"] * 4 and regenerated == [1]
    assert rounds.dropped_rows == 4 and rounds.metrics()["rollout/stale_rows_dropped"] == 4.0
    assert rounds.history[-1].staleness == 0 and rounds.version == 3


def test_a_background_exception_reaches_the_next_hand_over_with_its_cause():
    rounds = AsyncRounds(1, 1, 1, 1, sync_fn=lambda: None)
    with pytest.raises(BackgroundRoundError, match="launched in the background at step 1 failed.*unreachable") as e:
        drive(rounds, 4, fail_at=2)
    assert isinstance(e.value.__cause__, ConnectionError)
    assert [h.step for h in rounds.history] == [0, 1]  # raised at the hand-over of step 2, the round's own step


def _two_rank_fault(rank: int, store: str, out: str) -> None:
    """One rank of `test_a_background_fault_on_one_rank_stops_every_rank`: rank 1's round for step 2 fails."""
    import json
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    result = {"rank": rank, "error": None}
    try:
        drive(AsyncRounds(1, 1, 1, 1, sync_fn=lambda: None), 5, fail_at=2 if rank == 1 else None)
    except BackgroundRoundError as exc:
        result["error"] = str(exc)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_background_fault_on_one_rank_stops_every_rank(tmp_path):
    """2 gloo processes: rank 1's background round fails; both ranks raise at that hand-over, rank 0 naming rank
    1 and its cause (without the agreement rank 0 trained on and met the dead peer only at a later collective)."""
    import json

    import torch.multiprocessing as mp

    ctx = mp.start_processes(_two_rank_fault, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                             join=False, start_method="spawn")  # fmt: skip
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two ranks did not finish within 120 s")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["error"], "rank 0 did not stop with its peer's failed round"
    assert "step 1 failed: rank 1: ConnectionError" in r0["error"] and "every rank stops together" in r0["error"]
    assert r1["error"] and "rank 1: ConnectionError" in r1["error"] and "unreachable" in r1["error"]


def test_a_round_launched_for_another_batch_is_discarded():
    rounds = AsyncRounds(1, 1, 1, 1, sync_fn=lambda: None)
    it = iter([["a"], ["b"], ["c"]])
    (a,) = rounds.lookahead.pull(it, 1)
    rounds.next_round(a, 0, lambda: Round(["a"]), lambda inp: lambda: Round(["bg"]))
    out = rounds.next_round(["other"], 1, lambda: Round(["other"]), lambda inp: lambda: Round(["bg"]))
    assert out.rows == ["other"] and rounds.discarded_rounds == 1 and not rounds.history[-1].background


def test_lookahead_peeks_by_identity_within_one_epoch():
    look = BatchLookahead()
    epoch = [[i] for i in range(5)]
    it = iter(epoch)
    first = look.pull(it, 2)
    assert first == [[0], [1]] and look.peek(first[0], 2) is epoch[2] and look.peek(first[1], 3) is epoch[4]
    assert look.peek(first[1], 4) is None  # past the epoch's end
    assert look.pull(it, 3) == [[2], [3], [4]]  # the peeked batches come out in order, once
    assert look.peek([0], 1) is None  # equal content, another object: no match
    it2 = iter([[9]])
    assert look.pull(it2, 2) == [[9]]  # a new epoch starts clean


# ---- config ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, message",
    [
        ({"max_staleness": -1}, "max_staleness=-1 must be >= 0"),
        ({"weight_sync_steps": 2}, "weight_sync_steps=2 needs max_staleness >= 1"),
        ({"max_staleness": 1, "weight_sync_steps": 2}, "weight_sync_steps=2 > max_staleness=1"),
        ({"max_staleness": 1, "steps_per_generation": 2}, "2m − 1 <= max_staleness"),
        ({"max_staleness": 1, "vllm_importance_sampling_correction": False}, "behaviour-policy correction"),
        ({"max_staleness": 1, "async_fv_policy": "newest"}, "async_fv_policy='newest'"),
        ({"max_staleness": 1, "use_vllm": True, "vllm_mode": "colocate"}, "vllm_mode=colocate.*use vllm_mode=server"),
    ],
)
def test_config_refuses_what_the_bound_cannot_honour(tmp_path, kw, message):
    base = dict(num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match=message):
        APPOConfig(output_dir=str(tmp_path), **{**CPU, **base, **kw})


def test_max_staleness_one_and_two_steps_per_round_needs_three(tmp_path):
    kw = dict(num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=1, steps_per_generation=2)
    assert APPOConfig(output_dir=str(tmp_path), **{**CPU, **kw, "max_staleness": 3}).max_staleness == 3


@pytest.mark.parametrize("dist", [DistributedType.DEEPSPEED, DistributedType.FSDP])
def test_appo_in_the_background_is_refused_under_deepspeed_and_fsdp(tmp_path, dist):
    """APPO's selection forward runs on the round thread: under a sharded or DeepSpeed engine it would gather shards
    beside the trainer's collectives and race DeepSpeed's step inside backward, so `APPOTrainer.__init__` stops."""
    kw = dict(num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=1, max_staleness=1)
    vllm = dict(use_vllm=True, vllm_mode="server")

    def build(accel_type, **cfg):
        args = APPOConfig(output_dir=str(tmp_path), **{**CPU, **kw, **cfg})
        callbacks = []
        trainer = SimpleNamespace(args=args, accelerator=SimpleNamespace(distributed_type=accel_type),
                                  add_callback=callbacks.append)  # fmt: skip
        return build_async_rounds(trainer), callbacks

    appo = dict(rollout_strategy="appo", initial_rollouts=2, **vllm)
    with pytest.raises(ValueError, match=r"^rollout_strategy=appo with max_staleness >= 1 is not supported under "
                                         r"DeepSpeed or FSDP: .* Use max_staleness: 0, or DDP\.$"):  # fmt: skip
        build(dist, **appo)
    with pytest.raises(ValueError, match="the policy is sharded: use the vLLM server"):  # in-process: no full copy
        build(dist, rollout_strategy="grpo")
    rounds, callbacks = build(DistributedType.MULTI_GPU, **appo)  # DDP: the lock covers the step
    assert isinstance(rounds, AsyncRounds) and isinstance(callbacks[0], OptimizerStepLock)
    rounds, _ = build(dist, rollout_strategy="grpo", **vllm)  # no trainer forward off the trainer's thread
    assert isinstance(rounds, AsyncRounds)


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


GRPO = dict(tools=["python"], num_generations=4, per_device_train_batch_size=4, max_completion_length=64)


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


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


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


def _two_token_inputs(trainer):
    ln = math.log
    inputs = {
        "prompt_ids": torch.tensor([[5]]),
        "prompt_mask": torch.tensor([[1]]),
        "completion_ids": torch.tensor([[7, 8]]),
        "completion_mask": torch.tensor([[1, 1]]),
        "tool_mask": torch.tensor([[1, 1]]),
        "advantages": torch.tensor([1.0]),
        "old_per_token_logps": torch.tensor([[ln(0.4), ln(0.25)]]),  # proximal: the trainer at hand-over
        "sampling_per_token_logps": torch.tensor([[ln(0.2), ln(0.5)]]),  # behaviour: the sampler
        "num_items_in_batch": torch.tensor(2.0),
    }
    # TRL's truncated importance weight, as `_generate_and_score_completions` computes it (token_truncate, max 3)
    inputs["importance_sampling_ratio"] = torch.tensor([[0.4 / 0.2, 0.25 / 0.5]])
    current = torch.tensor([[ln(0.5), ln(0.25)]], requires_grad=True)  # π_θ

    def forward(model, input_ids, attention_mask, logits_to_keep, **kw):
        return current, torch.zeros(1, 2), None

    trainer._get_per_token_logps_and_entropies = forward
    return inputs


@pytest.mark.parametrize("loss_mode", ["clip", "dual_clip"])
def test_decoupled_ppo_correction_on_two_tokens(tmp_path, tiny_tokenizer, tiny_model_path, loss_mode):
    """r = π_θ/π_prox = (1.25, 1.0), clipped to (1.2, 1.0) (ε 0.2, A = 1); weight π_prox/π_behav = (2.0, 0.5);
    bnpo: −(1.2·2.0 + 1.0·0.5)/2 = −1.45 with the correction, −(1.2 + 1.0)/2 = −1.1 synchronously in-process."""
    losses = {}
    for k in (0, 1):
        trainer = make_trainer(
            tmp_path / str(k), tiny_tokenizer, tiny_model_path, ScriptedEngine(tiny_tokenizer), RewardSpy(),
            max_staleness=k, loss_type="bnpo", loss_mode=loss_mode, vllm_importance_sampling_mode="token_truncate",
            gradient_accumulation_steps=1, max_steps=1, **GRPO,
        )  # fmt: skip
        inputs = _two_token_inputs(trainer)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train
        losses[k] = trainer._compute_loss(trainer.model, inputs).item()
        assert trainer.use_vllm is False  # the flag is raised only for the span of TRL's loss
    assert losses[1] == pytest.approx(-1.45, abs=1e-6)
    assert losses[0] == pytest.approx(-1.1, abs=1e-6)


def test_importance_weight_is_computed_at_hand_over_from_the_proximal_policy(
    tmp_path, tiny_tokenizer, tiny_model_path
):
    trainer = make_trainer(
        tmp_path, tiny_tokenizer, tiny_model_path, ScriptedEngine(tiny_tokenizer), RewardSpy(), max_steps=2,
        max_staleness=1, vllm_importance_sampling_mode="token_truncate", **GRPO,
    )  # fmt: skip
    seen = []
    orig = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: seen.append(orig(inputs)) or seen[-1]
    trainer.train()
    for out in seen:
        mask = (out["completion_mask"] * out["tool_mask"]).bool()
        expected = torch.exp(out["old_per_token_logps"] - (-0.5)).clamp(max=3.0)  # scripted sampler logprob −0.5
        torch.testing.assert_close(out["importance_sampling_ratio"][mask], expected[mask])
    assert len(seen) == 2


class FarSampler(ScriptedEngine):
    """Odd rows of a group get sampler logprob −30 on their sampled tokens: their weight exp(old − sampler) is far
    above `vllm_importance_sampling_clip_max` (3), so truncation and masking give different weights."""

    async def rollout(self, prompts, n, **kw):
        groups = await super().rollout(prompts, n, **kw)
        for group in groups:
            for j, t in enumerate(group):
                if j % 2:
                    t.logprobs = [-30.0 if m else lp for m, lp in zip(t.loss_mask, t.logprobs)]
        return groups


def expected_is_weight(out, mode, clip_max=3.0):
    """TRL 1.16's vLLM importance-sampling weight for `mode`, from the batch's proximal and sampler logprobs."""
    mask = out["completion_mask"] * out["tool_mask"]
    diff = torch.nan_to_num((out["old_per_token_logps"] - out["sampling_per_token_logps"]) * mask, nan=0.0)
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    return ratio.clamp(max=clip_max) if mode.endswith("truncate") else ratio.masked_fill(ratio > clip_max, 0.0)


@pytest.mark.parametrize("loss_mode", ["clip", "future_kl"])
@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"])
def test_trls_importance_sampling_modes_apply_to_background_rounds(
    tmp_path, tiny_tokenizer, tiny_model_path, mode, loss_mode
):
    """Each of TRL's four `vllm_importance_sampling_mode`s, with TRL's loss and with future_kl: 2 async steps (one
    synchronous round, one from the background) train with a finite loss, and the weight of every round is TRL's
    for that mode (the mask modes zero the odd rows, the truncate modes cap them at 3)."""
    trainer = make_trainer(
        tmp_path, tiny_tokenizer, tiny_model_path, FarSampler(tiny_tokenizer), RewardSpy(), max_steps=2,
        max_staleness=1, vllm_importance_sampling_mode=mode, loss_mode=loss_mode, **GRPO,
    )  # fmt: skip
    seen = []
    orig = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: seen.append(orig(inputs)) or seen[-1]
    trainer.train()
    assert [h.background for h in trainer.rounds.async_rounds.history] == [False, True]
    for out in seen:
        expected = expected_is_weight(out, mode)
        torch.testing.assert_close(out["importance_sampling_ratio"], expected)
        sampled = (out["completion_mask"] * out["tool_mask"])[1::2].bool()
        far = expected[1::2] if mode.startswith("sequence") else expected[1::2][sampled]
        assert (far == (0.0 if mode.endswith("mask") else 3.0)).all()
    logs = [e for e in trainer.state.log_history if "rollout/staleness/max" in e]
    assert len(logs) == 2 and all(math.isfinite(e["loss"]) for e in logs)
    assert all("sampling/importance_sampling_ratio/mean" in e for e in logs)


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


def test_appo_selection_forward_never_overlaps_an_optimizer_step(
    tmp_path, tiny_tokenizer, tiny_model_path, monkeypatch
):
    spans = {"forward": [], "step": []}
    real_step = torch.optim.AdamW.step

    def slow_step(self, *a, **k):
        t0 = time.monotonic()
        time.sleep(0.05)
        out = real_step(self, *a, **k)
        spans["step"].append((t0, time.monotonic()))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", slow_step)
    trainer = make_trainer(
        tmp_path, tiny_tokenizer, tiny_model_path, ScriptedEngine(tiny_tokenizer), RewardSpy(),
        rollout_strategy="appo", num_generations=4, initial_rollouts=2, per_device_train_batch_size=4,
        max_completion_length=64, min_remaining_tokens=1, tools=["python"], max_steps=4, max_staleness=1,
        branch_entropy_source="trainer",
    )  # fmt: skip
    real_forward = trainer._get_per_token_logps_and_entropies

    def forward(*a, **k):
        if threading.current_thread() is threading.main_thread():
            return real_forward(*a, **k)
        t0 = time.monotonic()
        time.sleep(0.3)  # a slow selection forward: without the lock it would straddle an optimizer step
        out = real_forward(*a, **k)
        spans["forward"].append((t0, time.monotonic()))
        return out

    trainer._get_per_token_logps_and_entropies = forward
    trainer.train()
    assert len(spans["forward"]) == 3 and len(spans["step"]) == 4
    for f0, f1 in spans["forward"]:
        for s0, s1 in spans["step"]:
            assert f1 <= s0 or s1 <= f0, "an APPO selection forward overlapped an optimizer step"
    # async_fv_policy=proximal: the round launched at step j scores after optimizer step j (its proximal weights)
    for (f0, _), (_, s1) in zip(spans["forward"], spans["step"]):
        assert f0 >= s1


class SlowStepEnd(TrainerCallback):
    """Pauses after each optimizer step: a selection forward that may run before its hand-over runs then."""

    def on_step_end(self, args, state, control, **kw):
        time.sleep(0.3)


def test_appo_selection_forward_reads_the_hand_over_weights_with_two_steps_per_round(
    tmp_path, tiny_tokenizer, tiny_model_path
):
    """m = 2 optimizer steps per round (steps_per_generation 2, max_staleness 3): the round launched at step v
    scores its branches on the weights of its hand-over, v + 2, the proximal policy of its loss (with a ticket of
    v + 1 it read the weights of step v + 1, between the two steps)."""
    trainer = make_trainer(
        tmp_path, tiny_tokenizer, tiny_model_path, ScriptedEngine(tiny_tokenizer), RewardSpy(),
        rollout_strategy="appo", num_generations=4, initial_rollouts=2, per_device_train_batch_size=4,
        steps_per_generation=2, gradient_accumulation_steps=1, max_completion_length=64, min_remaining_tokens=1,
        tools=["python"], max_steps=6, max_staleness=3, branch_entropy_source="trainer",
    )  # fmt: skip
    assert trainer.rounds.async_rounds.m == 2
    trainer.add_callback(SlowStepEnd())
    scored, handed = [], {}
    real_forward = trainer._get_per_token_logps_and_entropies

    def forward(model, *a, **k):
        if threading.current_thread() is not threading.main_thread():  # inside trainer_forward: weights_lock held
            scored.append((trainer.rounds.async_rounds.optimizer_steps, _weights(model)))
        return real_forward(model, *a, **k)

    real_next_round = trainer.rounds.async_rounds.next_round

    def next_round(inputs, step, *a, **k):
        handed[step] = _weights(trainer.model)
        return real_next_round(inputs, step, *a, **k)

    trainer._get_per_token_logps_and_entropies = forward
    trainer.rounds.async_rounds.next_round = next_round
    trainer.train()
    assert [(h.step, h.version, h.background) for h in trainer.rounds.async_rounds.history] == [
        (0, 0, False), (2, 0, True), (4, 2, True)
    ]  # fmt: skip
    assert [steps for steps, _ in scored] == [2, 4]
    for steps, weights in scored:
        assert all(torch.equal(weights[k], handed[steps][k]) for k in weights), f"not the weights of step {steps}"


def test_evaluation_between_hand_overs_drops_a_round_waiting_for_its_weights():
    """m = 2: evaluation after the first of the two steps must not wait for a selection forward that waits for the
    second (a deadlock): that round is dropped and regenerated at its hand-over; a round without such a forward
    is kept."""
    rounds = AsyncRounds(3, 1, 2, 2, sync_fn=lambda: None)
    lock = OptimizerStepLock(rounds)

    def optimizer_step():
        lock.on_pre_optimizer_step(None, None, None)
        lock.on_optimizer_step(None, None, None)

    def appo_job(inputs):
        def job():
            with rounds.trainer_forward():
                return Round(rows=[("scored at", rounds.optimizer_steps)] * 4)

        return job

    it = iter([["a"], ["b"], ["c"], ["d"], ["e"], ["f"]])
    (a,) = rounds.lookahead.pull(it, 1)
    rounds.next_round(a, 0, lambda: Round(rows=["a"] * 4), appo_job)
    optimizer_step()
    evaluation = threading.Thread(target=rounds.before_foreground_round, args=(1,), daemon=True)  # at step 1
    evaluation.start()
    evaluation.join(timeout=10)
    if evaluation.is_alive():
        rounds.closed = True  # releases the waiting forward (and with it the evaluation thread)
        pytest.fail("evaluation waited for a round that waited for the weights of the step after evaluation")
    assert rounds.pending is None and rounds.discarded_rounds == 1
    optimizer_step()
    rounds.lookahead.pull(it, 1)
    (c,) = rounds.lookahead.pull(it, 1)
    plain_job = lambda inputs: lambda: Round(rows=[inputs[0]] * 4)  # noqa: E731 - no trainer forward (GRPO)
    out = rounds.next_round(c, 2, lambda: Round(rows=["c now"] * 4), plain_job)
    assert out.rows == ["c now"] * 4 and not rounds.history[-1].background
    optimizer_step()
    rounds.before_foreground_round(3)  # evaluation at step 3: the round for e finishes and is kept
    assert rounds.pending is not None and rounds.discarded_rounds == 1
    optimizer_step()
    rounds.lookahead.pull(it, 1)
    (e,) = rounds.lookahead.pull(it, 1)
    out = rounds.next_round(e, 4, lambda: Round(rows=["e now"] * 4), plain_job)
    assert out.rows == ["e"] * 4 and rounds.history[-1].background


def test_evaluation_between_hand_overs_in_training(tmp_path, tiny_tokenizer, tiny_model_path):
    """APPO, m = 2, evaluation after every step: the evaluation at step 1 drops the round waiting for the weights of
    step 2 (generated at its hand-over instead), and training ends instead of waiting forever."""
    from appo_trl.trainer.trainer import APPOTrainer

    kw = dict(rollout_strategy="appo", num_generations=4, initial_rollouts=2, per_device_train_batch_size=4,
              steps_per_generation=2, gradient_accumulation_steps=1, max_completion_length=64, min_remaining_tokens=1,
              tools=["python"], max_steps=4, max_staleness=3, branch_entropy_source="trainer", eval_strategy="steps",
              eval_steps=1, per_device_eval_batch_size=4, num_generations_eval=1)  # fmt: skip
    trainer = APPOTrainer(
        model=tiny_model_path, reward_funcs=[RewardSpy()], args=APPOConfig(output_dir=str(tmp_path), **{**CPU, **kw}),
        train_dataset=dataset(), eval_dataset=dataset(4), processing_class=tiny_tokenizer,
        rollout_engine=ScriptedEngine(tiny_tokenizer),
    )  # fmt: skip
    run = threading.Thread(target=trainer.train, daemon=True)
    run.start()
    run.join(timeout=60)
    if run.is_alive():
        trainer.rounds.async_rounds.closed = True  # releases the waiting forward
        pytest.fail("evaluation between two hand-overs waited for a round that waited for the next step")
    assert [(h.step, h.version, h.background) for h in trainer.rounds.async_rounds.history] == [
        (0, 0, False),
        (2, 2, False),
    ]
    assert trainer.rounds.async_rounds.discarded_rounds == 1 and trainer.state.global_step == 4
    assert [e["step"] for e in trainer.state.log_history if "eval_reward" in e] == [1, 2, 3, 4]


def test_appo_selection_with_the_sampler_copy(tmp_path, tiny_tokenizer, tiny_model_path):
    trainer = make_trainer(
        tmp_path, tiny_tokenizer, tiny_model_path, ScriptedEngine(tiny_tokenizer), RewardSpy(),
        rollout_strategy="appo", num_generations=4, initial_rollouts=2, per_device_train_batch_size=4,
        max_completion_length=64, min_remaining_tokens=1, tools=["python"], max_steps=3, max_staleness=1,
        branch_entropy_source="trainer", async_fv_policy="sampler",
    )  # fmt: skip
    models = []
    real_forward = trainer._get_per_token_logps_and_entropies

    def forward(model, *a, **k):
        if threading.current_thread() is not threading.main_thread():
            models.append(model)
        return real_forward(model, *a, **k)

    trainer._get_per_token_logps_and_entropies = forward
    trainer.train()
    assert len(models) == 2 and all(m is trainer.rounds.sampler.model for m in models)


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
