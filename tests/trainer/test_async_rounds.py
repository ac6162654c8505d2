"""`max_staleness >= 1`: the background-round scheduler (appo_trl.trainer.async_rounds) alone, and its config.

Pinned: the staleness of every handed round and the sync schedule for (k, weight_sync_steps) by hand; a stale
round is dropped and regenerated; a background exception reaches the next hand-over with its cause, on every rank;
a round launched for another batch is discarded; the config refuses what the bound cannot honour, and APPO in the
background is refused under DeepSpeed / FSDP. Through the trainer: test_async_trainer.py, test_async_policies.py.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from appo_trl.config import APPOConfig
from appo_trl.trainer.async_rounds import (
    AsyncRounds,
    BackgroundRoundError,
    BatchLookahead,
    OptimizerStepLock,
    build_async_rounds,
)
from tests.trainer.async_helpers import Round
from tests.trainer.test_trainer import CPU


# ---- the scheduler alone --------------------------------------------------------------------------------------
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


def test_lookahead_peeks_across_the_epoch_end_and_the_loop_gets_that_epoch_once():
    """Past the end a peek starts the next epoch's iterator (once); the loop's own iterator for that epoch is
    then not read: each epoch's order is drawn once, as without the lookahead."""
    made = []

    def next_epoch():
        made.append(len(made))
        return iter([[10], [11], [12]])

    look = BatchLookahead(next_epoch)
    it = iter([[0], [1]])
    first = look.pull(it, 1)
    assert look.peek(first[0], 1) == [1] and not made  # within the epoch: nothing started
    ahead = look.peek(first[0], 2)
    assert ahead == [10] and look.peek(first[0], 4) == [12] and look.peek(first[0], 5) is None and made == [0]
    assert look.pull(it, 2) == [[1]]  # the epoch ends where it ended
    unread = iter([[99]])  # the loop's own iterator for the next epoch: drawn again, it would be another order
    second = look.pull(unread, 2)
    assert second == [[10], [11]] and second[0] is ahead and next(unread) == [99] and made == [0]
    assert look.peek(second[1], 1) == [12] and look.pull(unread, 2) == [[12]]
    for last in (BatchLookahead(), BatchLookahead(lambda: None)):  # no next epoch, or the training ends with this one
        assert last.peek(last.pull(iter([[0]]), 1)[0], 1) is None


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
