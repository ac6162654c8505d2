"""`rollout_stream: true` end to end on the tiny model against the scripted pausable server (bench/pausable_vllm.py):
groups stream, the weights sync in flight at every hand-over (keep pause, no prefix-cache reset), every row's
tokens carry their policy versions into the Round and the rollout dump; a server without /pause falls back to the
max_staleness rounds with one line."""

from __future__ import annotations

import concurrent.futures
import glob
import json
import logging
import threading

import pytest

from bench.pausable_vllm import PausableVLLM
from tests.trainer.test_trainer import RewardSpy, make_trainer

pytestmark = pytest.mark.network
STREAM = dict(use_vllm=True, vllm_mode="server", num_generations=2, per_device_train_batch_size=4,
              max_completion_length=24, max_staleness=2, rollout_stream=True)  # fmt: skip


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_groups_stream_and_the_weights_update_in_flight(tmp_path, tiny_tokenizer, tiny_model_path, mode):
    before = set(threading.enumerate())  # other tests' threads in this process are not this run's
    server = PausableVLLM(step_s=0.01).start()
    try:
        trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(), max_steps=4,
                               vllm_server_base_url=server.url, stream_overprovision=0.5, dump_rollouts=2,
                               inflight_update=mode, **STREAM)  # fmt: skip
        assert trainer.rounds.stream is not None and trainer.rounds.async_rounds is None
        stream, handed = trainer.rounds.stream, []
        take = stream.take_round
        stream.take_round = lambda prompts: handed.append(take(prompts)) or handed[-1]
        trainer.train()
    finally:
        server.stop()
    assert trainer.state.global_step == 4 and len(handed) == 4
    assert server.calls.count(f"pause:{mode}") == 4 and server.calls.count("resume") == 4  # one sync per hand-over
    assert "reset_prefix_cache" not in server.calls  # the per-version cache salt replaces it
    assert server.weights == 4 and stream.clock.version == 3
    for step, (rnd, oldest) in enumerate(handed):
        assert len(rnd.groups) == 2 and all(len(g) == 2 for g in rnd.groups) and all(rnd.keep)
        for row in rnd.rows:
            assert row.versions is not None and len(row.versions) == len(row.completion_ids)
            assert row.versions == sorted(row.versions) and max(row.versions) <= step
            assert step - row.oldest_version() <= 2  # the bound, per token
        assert oldest == min(r.oldest_version() for r in rnd.rows)
    # the server stamps its own version in each logprob: a token's version names the weights it was sampled on
    for rnd, _ in handed:
        for row in rnd.rows:
            assert all(lp == pytest.approx(-(2 + v) / 10) for lp, v in zip(row.logprobs, row.versions))
    records = [json.loads(x) for f in sorted(glob.glob(f"{tmp_path}/rollouts/step_*.jsonl")) for x in open(f)]
    assert records and all(r["version_runs"] for rec in records for r in rec["rows"])
    assert stream.stream is None  # closed at the end of training
    left = [t for t in set(threading.enumerate()) - before if t.name.startswith(("appo-round", "appo-rollout"))]
    assert not [t.name for t in left if t.is_alive()]  # the run's own loops are closed; other tests' are not ours


def test_a_server_without_pause_gets_one_line_and_the_rounds_of_today(tmp_path, tiny_tokenizer, tiny_model_path,
                                                                      caplog):  # fmt: skip
    server = PausableVLLM(no_pause_routes=True).start()
    try:
        with caplog.at_level(logging.WARNING):
            trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(), max_steps=1,
                                   vllm_server_base_url=server.url, **STREAM)  # fmt: skip
    finally:
        server.stop()
    assert trainer.rounds.stream is None and trainer.rounds.async_rounds is not None
    lines = [r.getMessage() for r in caplog.records if "/pause" in r.getMessage()]
    assert len(lines) == 1 and "the weights sync between rounds" in lines[0]


def test_a_resume_that_fails_during_training_is_one_line_and_leaves_nothing_running(tmp_path, tiny_tokenizer,
                                                                                     tiny_model_path):  # fmt: skip
    from appo_trl.vllm.inflight import InFlightUpdateError

    before = set(threading.enumerate())  # other tests' threads in this process are not this run's
    server = PausableVLLM(step_s=0.01, resume_fails=3).start()  # the first sync's three /resume attempts fail
    try:
        trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(), max_steps=2,
                               vllm_server_base_url=server.url, **STREAM)  # fmt: skip
        with pytest.raises(InFlightUpdateError, match="is still paused: POST /resume answered HTTP 500"):
            trainer.train()
    finally:
        server.stop()
    assert trainer.rounds.stream.stream is None  # closed: no group starts, none left in flight
    left = [t for t in set(threading.enumerate()) - before if t.name.startswith(("appo-round", "appo-rollout"))]
    assert not [t.name for t in left if t.is_alive()]  # joined before the error reached the caller


def never_finishing_third_group(stream_rounds) -> list[list[int]]:
    """The third group started (the first of step 1's batch) never finishes: it carries over. The prompts started."""
    started, real = [], stream_rounds._start_group

    def start(group):
        fut = real(group)
        started.append(list(group.prompt_ids))
        return concurrent.futures.Future() if len(started) == 3 else fut  # cancelled when the stream closes

    stream_rounds._start_group = start
    return started


def later_groups_wait_for_the_first(stream_rounds) -> list[list[int]]:
    """Every group after the first completes only once the first has: which group finishes first is then fixed."""
    started, real = [], stream_rounds._start_group

    def start(group):
        fut = real(group)
        started.append((list(group.prompt_ids), fut, stream_rounds.clock.version))  # the version it starts under
        if len(started) == 1:
            return fut
        both, first = concurrent.futures.Future(), started[0][1]

        def hand_on(_):
            if both.set_running_or_notify_cancel():  # False: the stream closed and cancelled it
                both.set_exception(fut.exception()) if fut.exception() else both.set_result(fut.result())

        fut.add_done_callback(lambda _: first.add_done_callback(hand_on))
        both.add_done_callback(lambda f: f.cancelled() and fut.cancel())
        return both

    stream_rounds._start_group = start
    return started


def test_a_resume_samples_the_groups_carried_over_again_and_says_so(tmp_path, tiny_tokenizer, tiny_model_path,
                                                                    caplog):  # fmt: skip
    server = PausableVLLM(step_s=0.005).start()
    kw = dict(vllm_server_base_url=server.url, save_strategy="steps", save_steps=1, stream_overprovision=0.5, **STREAM)
    try:  # 3 groups held for batches of 2: the two others pass the stuck one
        with caplog.at_level(logging.INFO):
            first = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(), max_steps=2, **kw)
            started = never_finishing_third_group(first.rounds.stream)
            first.train()
            saved = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint at step 2")]
            caplog.clear()
            trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(), max_steps=3, **kw)
            stream, handed = trainer.rounds.stream, []
            take = stream.take_round
            stream.take_round = lambda prompts: handed.append(take(prompts)) or handed[-1]
            restarted = later_groups_wait_for_the_first(stream)
            trainer.train(resume_from_checkpoint=True)
    finally:
        server.stop()
    state = json.load(open(tmp_path / "checkpoint-2" / "appo_sampler_state.json"))["stream"]
    assert state["step"] == 2 and [g["prompt_ids"] for g in state["groups"]] == [started[2]]
    assert len(state["groups"][0]["inputs"]) == 2  # the group's n rows, as TRL's sampler gave them
    assert len(saved) == 1 and "1 group(s) carried over from earlier batches are saved" in saved[0]
    assert trainer.state.global_step == 3 and len(handed) == 1
    assert restarted[0][0] == started[2]  # the carried group is sampled again before the resumed batch's groups
    # ... once the server holds the resumed weights (before, its first tokens were the server's old weights, stamped
    # with no version the resume knows, and the group could be dropped as too stale: a flake in CI)
    assert [v for *_, v in restarted] == [2] * len(restarted)
    rnd, _ = handed[0]
    assert rnd.groups[0][0].prompt_ids == started[2]  # the oldest complete group is handed over first
    resumed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[resume]")]
    assert resumed == ["[resume] 1 group(s) were in flight at checkpoint-2; they are sampled again"]


def test_an_evaluation_during_streaming_syncs_the_weights_in_flight(tmp_path, tiny_tokenizer, tiny_model_path):
    """eval_strategy: steps: an evaluation round at step s moves the server to s's weights by the in-flight route
    (paused, reloaded, the clock advanced, resumed), never by the between-rounds sync under the groups in flight."""
    from appo_trl.config import APPOConfig
    from appo_trl.trainer.trainer import APPOTrainer
    from tests.trainer.test_trainer import CPU, dataset

    server = PausableVLLM(step_s=0.005).start()
    try:
        args = APPOConfig(output_dir=str(tmp_path), **{**CPU, **STREAM}, max_steps=4, eval_strategy="steps",
                          eval_steps=2, per_device_eval_batch_size=4, num_generations_eval=2,
                          vllm_server_base_url=server.url)  # fmt: skip
        trainer = APPOTrainer(model=tiny_model_path, reward_funcs=[RewardSpy()], args=args, train_dataset=dataset(),
                              eval_dataset=dataset(4), processing_class=tiny_tokenizer)  # fmt: skip
        trainer.train()
    finally:
        server.stop()
    evals = [h for h in trainer.state.log_history if "eval_loss" in h or any(k.startswith("eval_") for k in h)]
    assert [h["step"] for h in evals] == [2, 4]
    # hand-overs at steps 0, 1, 3 and evaluations at 2 and 4 (step 2's hand-over found the weights there)
    assert server.calls.count("pause:keep") == 5 and server.calls.count("resume") == 5 and server.weights == 5
    assert "reset_prefix_cache" not in server.calls  # the between-rounds disk route never ran
    assert trainer.rounds.stream.clock.version == 4


def _zero(completions, **_) -> list[float]:
    return [0.0] * len(completions)


def _prompts(batch) -> list[str]:
    return [row["prompt"][-1]["content"] for row in batch]


def test_the_stream_looks_ahead_across_an_epoch_end_and_feeds_the_batches_of_a_plain_run(tmp_path, tiny_tokenizer,
                                                                                       tiny_model_path):  # fmt: skip
    """Epochs of two generation batches (8 prompts, 4 per batch), 4 steps: the batches of epoch 1 are fed to the
    stream while epoch 0 still trains, and they are the batches, in order, that a run without streaming trains on
    (the next epoch's iterator is started once, as the Trainer starts it, and the loop's own is not read)."""
    kw = dict(STREAM, per_device_train_batch_size=8, max_steps=4)
    server = PausableVLLM(step_s=0.005).start()
    try:
        plain = make_trainer(tmp_path / "plain", tiny_tokenizer, tiny_model_path, None, _zero,
                             **{**kw, "rollout_stream": False, "max_staleness": 0, "use_vllm": False})  # fmt: skip
        pulled, pull = [], plain.get_batch_samples
        plain.get_batch_samples = lambda it, n, device: (r := pull(it, n, device), pulled.extend(r[0]))[0]
        plain.train()
        trainer = make_trainer(tmp_path / "stream", tiny_tokenizer, tiny_model_path, None, RewardSpy(),
                               vllm_server_base_url=server.url, **kw)  # fmt: skip
        rounds, fed = trainer.rounds.stream, []
        feed = rounds._feed
        rounds._feed = lambda batch, step: (
            fed.append((trainer.state.global_step, _prompts(batch))) if batch is not None and id(batch) not in
            rounds._fed else None, feed(batch, step))  # fmt: skip
        trainer.train()
    finally:
        server.stop()
    assert len(pulled) == 4 and trainer.state.global_step == 4
    assert [p for _, p in fed] == [_prompts(b) for b in pulled]  # the same batches, in the same order
    assert [s for s, _ in fed] == [0, 0, 0, 1]  # epoch 1's batches (steps 2, 3) fed at steps 0 and 1
    assert sorted(_prompts(pulled[0]) + _prompts(pulled[1])) == sorted(_prompts(pulled[2]) + _prompts(pulled[3]))
