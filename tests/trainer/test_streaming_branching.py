"""`rollout_stream: true` with a branching strategy (ARPO, AEPO): each streamed group is one prompt's tree, sampled
by the strategy's own `generate` on that prompt (roots, branches after tool results by its entropy rule, refills),
admitted whole; the trees' metrics are the round's. A scripted chat sampler makes two tool calls, then answers,
on the in-process route (its tokens carry no versions: each row takes its group's start version)."""

from __future__ import annotations

import pytest

from appo_trl.config import APPOConfig
from appo_trl.trainer.trainer import APPOTrainer
from tests.trainer.test_agents import ScriptedBackend
from tests.trainer.test_chat_tools import STRATEGY, Reward, multiply, prompts
from tests.trainer.test_trainer import CPU


@pytest.mark.parametrize("strategy", ["arpo", "aepo"])
def test_trees_stream_whole_and_report_their_branching(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path, strategy):
    tok = tiny_chat_tokenizer
    args = APPOConfig(output_dir=str(tmp_path), **CPU, rollout_strategy=strategy, num_generations=4,
                      per_device_train_batch_size=8, max_steps=3, max_completion_length=96, max_staleness=2,
                      rollout_stream=True, stream_overprovision=0.5, **STRATEGY[strategy])  # fmt: skip
    trainer = APPOTrainer(model=tiny_chat_model_path, reward_funcs=[Reward()], args=args, train_dataset=prompts(),
                          processing_class=tok, tools=[multiply])  # fmt: skip
    trainer.rollout_engine.backend = ScriptedBackend(tok)
    stream, handed = trainer.rounds.stream, []
    take = stream.take_round
    stream.take_round = lambda inputs: handed.append(take(inputs)) or handed[-1]
    trainer.train()
    assert trainer.state.global_step == 3 and len(handed) == 3
    forks = 0
    for rnd, _ in handed:
        assert len(rnd.groups) == 2 and all(len(g) == 4 for g in rnd.groups) and all(rnd.keep)
        for group in rnd.groups:
            uids = {r.uid for r in group}
            assert len({r.prompt_ids[:8] == group[0].prompt_ids[:8] for r in group}) == 1  # one prompt per tree
            for row in group:
                if row.origin == "fork":  # a branch: its parent is in its own tree, its prefix the parent's
                    forks += 1
                    assert row.parent in uids
                    parent = next(r for r in group if r.uid == row.parent)
                    assert row.completion_ids[: row.branch_pos] == parent.completion_ids[: row.branch_pos]
        assert set(rnd.metrics) >= {"branch/points_per_prompt", "branch/initial_per_prompt"}
    assert forks > 0  # the rule branched after the tool results
    logs = [h for h in trainer.state.log_history if "rollout/stream/pause_s" in h]
    assert len(logs) == 3 and all(h["branch/points_per_prompt"] > 0 for h in logs)


def test_appo_and_branching_on_other_paths_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="rollout_strategy=appo: its branch selection is a forward of the policy"):
        APPOConfig(output_dir=str(tmp_path), **CPU, rollout_strategy="appo", max_staleness=1, rollout_stream=True)
