"""`GroupStream` (appo_trl/trainer/streaming.py): the bound, the oldest complete groups, whole-group drops,
carry-over and per-token staleness, with groups whose futures the test completes by hand."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

from appo_trl.rollout.types import Trajectory
from appo_trl.trainer.streaming import GroupStream, StreamDry

N = 2


class Sampler:
    """`start_group` whose futures the test completes: `finish(g, versions)` gives group g's rows those versions."""

    def __init__(self):
        self.started: list[tuple[list[int], int, concurrent.futures.Future]] = []
        self.version = 0

    def start(self, group):
        fut = concurrent.futures.Future()
        self.started.append((group.prompt_ids, group.seed, fut))
        return fut

    def finish(self, i: int, versions: list[list[int]] | None = None, error: Exception | None = None):
        prompt, _, fut = self.started[i]
        if error is not None:
            fut.set_exception(error)
            return
        rows = []
        for r in range(N):
            t = Trajectory(prompt_ids=list(prompt))
            vs = versions[r] if versions else None
            t.append([7] * (len(vs) if vs else 3), 1, [-0.5] * (len(vs) if vs else 3), versions=vs)
            t.append([9], 0)  # an injected token: not sampled, in no staleness
            rows.append(t)
        fut.set_result(rows)


def rows_for(prompts):
    return [{"prompt": p} for p in prompts for _ in range(N)]


def stream(sampler, max_groups=3, k=2, m=1):
    return GroupStream(sampler.start, lambda: sampler.version, group_size=N, max_groups=max_groups, max_staleness=k,
                       steps_per_round=m)  # fmt: skip


def test_at_most_max_groups_held_and_the_next_starts_when_one_is_taken():
    s = Sampler()
    gs = stream(s, max_groups=3)
    gs.feed(rows_for("abcde"), [[1], [2], [3], [4], [5]], [11, 12, 13, 14, 15])
    assert len(s.started) == 3 and gs.queued == 2  # the bound: 3 sampling, 2 waiting
    s.finish(0), s.finish(1)
    assert len(s.started) == 3  # complete groups stay in the buffer: still 3 held
    batch = gs.take(2, step=0)
    assert [g.order for g in batch.groups] == [0, 1] and [r["prompt"] for r in batch.inputs] == list("aabb")
    assert len(s.started) == 5 and [seed for _, seed, _ in s.started] == [11, 12, 13, 14, 15]


def test_the_oldest_complete_groups_pass_an_unfinished_older_one_which_carries_over():
    s = Sampler()
    gs = stream(s, max_groups=4)
    gs.feed(rows_for("abcd"), [[1], [2], [3], [4]], [1, 2, 3, 4])
    s.finish(3), s.finish(2), s.finish(1)  # group 0 (the long tail) still samples
    batch = gs.take(2, step=0)
    assert [g.order for g in batch.groups] == [1, 2]  # the oldest of the complete ones
    assert batch.carried_groups == 2 and [g.order for g in gs.in_flight()] == [0]
    s.finish(0)
    assert [g.order for g in gs.take(2, step=0).groups] == [0, 3]


def test_a_too_stale_group_is_dropped_whole_and_its_prompt_sampled_again():
    s = Sampler()
    gs = stream(s, max_groups=2, k=2, m=2)  # admitted while step - oldest + 1 <= 2
    gs.feed(rows_for("ab"), [[1], [2]], [5, 6])
    s.finish(0, versions=[[0, 0, 1], [1, 1]])  # one token of version 0: 2 - 0 + 1 = 3 > 2 at step 2
    s.finish(1, versions=[[1, 1], [2, 2]])
    s.version = 2
    with pytest.raises(TimeoutError):  # group 0 was dropped (both rows) and re-started; it has not finished
        gs.take(2, step=2, timeout_s=0.2)
    assert gs.dropped_groups == 1 and gs.dropped_rows == 2
    prompt, seed, _ = s.started[2]
    assert prompt == [1] and seed != 5  # the same prompt, a fresh draw
    s.finish(2, versions=[[2], [2, 2]])
    batch = gs.take(2, step=2)
    assert [g.order for g in batch.groups] == [0, 1] and batch.dropped_groups == 0
    # per sampled token at step 2: group 0: 0, 0, 0; group 1: 1, 1, 0, 0 (the injected tokens count for nothing)
    assert batch.staleness_max == 1 and batch.staleness_mean == pytest.approx(2 / 7)


def test_group_versions_fall_back_to_the_version_it_started_under():
    s = Sampler()
    s.version = 3
    gs = stream(s, k=1)
    gs.feed(rows_for("a"), [[1]], [1])
    s.finish(0)  # no versions recorded
    batch = gs.take(1, step=4)  # 4 - 3 + 0 = 1 <= 1
    assert batch.staleness_mean == 1.0 and batch.staleness_max == 1


def test_a_failed_group_raises_its_own_error_and_a_dry_stream_says_so():
    s = Sampler()
    gs = stream(s)
    gs.feed(rows_for("a"), [[1]], [1])
    with pytest.raises(StreamDry, match="needs 2 groups but only 1"):
        gs.take(2, step=0)
    s.finish(0, error=ValueError("tool sandbox died"))
    with pytest.raises(ValueError, match="tool sandbox died"):
        gs.take(1, step=0)


def test_feed_refuses_rows_that_are_not_whole_groups():
    gs = stream(Sampler())
    with pytest.raises(ValueError, match="3 rows for 1 prompts of 2 rows"):
        gs.feed([{"prompt": "a"}] * 3, [[1]], [1])
    with pytest.raises(ValueError, match="rows 0-1 are not one prompt's group"):
        gs.feed([{"prompt": "a"}, {"prompt": "b"}], [[1]], [1])


def test_buffer_bytes_count_the_held_groups_tokens_and_close_cancels_what_samples():
    s = Sampler()
    gs = stream(s, max_groups=2)
    gs.feed(rows_for("abc"), [[1, 2], [3, 4], [5, 6]], [1, 2, 3])
    before = gs.buffer_bytes()
    s.finish(0)
    assert gs.buffer_bytes() - before == 2 * 4 * 144  # two rows of 4 completion tokens each
    assert gs.close() == 3 and s.started[1][2].cancelled()


def test_trajectory_versions_runs_prefix_copy_and_oldest():
    t = Trajectory(prompt_ids=[1])
    t.append([5], 0)  # injected before any sampled token: takes the first sampled token's version
    t.append([6, 7], 1, [-1.0, -1.0], versions=[3, 3])
    t.append([8], 0)
    t.append([9], 1, [-1.0], versions=[4])
    t.check()
    assert t.versions == [3, 3, 3, 3, 4] and t.version_runs == [(3, 4), (4, 1)] and t.oldest_version() == 3
    child = t.prefix_copy(2)
    assert child.versions == [3, 3]
    with pytest.raises(ValueError, match="sampled tokens without policy versions"):
        t.append([10], 1, [-1.0])
    assert Trajectory(prompt_ids=[1]).version_runs is None


def test_a_checkpoint_keeps_the_groups_of_earlier_batches_and_only_those():
    from appo_trl.trainer.streaming import StreamCheckpoint

    s = Sampler()
    gs = stream(s, max_groups=4)
    gs.feed(rows_for("ab"), [[1], [2]], [11, 12], step=0)
    gs.feed(rows_for("cd"), [[3], [4]], [13, 14], step=1)
    gs.feed(rows_for("e"), [[5]], [15], step=2)  # queued: the bound is 4
    s.finish(1), s.finish(2)
    assert [g.order for g in gs.take(2, step=0).groups] == [1, 2]  # "a" (step 0) and "d" (step 1) carry over
    ckpt = StreamCheckpoint.of(gs, step=1)
    assert [g.inputs for g in ckpt.groups] == [rows_for("a")] and ckpt.groups[0].prompt_ids == [1]
    assert ckpt.groups[0].seed == 11 and ckpt.not_saved == 0
    at2 = StreamCheckpoint.of(gs, step=2)  # "d" was fed for step 1: a resume at 2 does not feed it again
    assert [g.inputs[0]["prompt"] for g in at2.groups] == ["a", "d"]
    back = StreamCheckpoint.from_json(json.loads(json.dumps(at2.to_json())))
    assert back == at2
    assert StreamCheckpoint.of(None, step=3) == StreamCheckpoint(3, [])


def test_a_carried_group_whose_rows_are_not_json_is_counted_not_saved():
    from appo_trl.trainer.streaming import StreamCheckpoint

    s = Sampler()
    gs = stream(s, max_groups=4)
    gs.feed([{"prompt": "a", "image": object()}] * N + rows_for("b"), [[1], [2]], [1, 2], step=0)
    ckpt = StreamCheckpoint.of(gs, step=1)
    assert [g.inputs[0]["prompt"] for g in ckpt.groups] == ["b"] and ckpt.not_saved == 1
