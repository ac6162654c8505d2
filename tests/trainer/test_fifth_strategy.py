"""A fifth strategy defined only here ("grpo with a fixed branch at the middle token") is registered, accepted by
`APPOConfig`, and trains two steps on the tiny model through the real in-process rollout engine: no library change.

It starts N = n / 2 rollouts per prompt, then branches each one once from the middle token of its completion
(the engine's `branch_many`, as APPO does), so every group holds N roots and N branches; every row reaches TRL's
`clip` loss. Its own config check lives beside it (`validate`), as the built-in strategies' do.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from appo_trl.config import APPOConfig
from appo_trl.strategies import STRATEGIES, RolloutStrategy, Round, register_strategy

CPU = dict(use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1, learning_rate=1e-2,
           beta=0.0, seed=0, loss_type="dapo")  # fmt: skip


class MiddleBranchStrategy(RolloutStrategy):
    """N roots per prompt, each branched once at the middle token of its completion (n = 2N)."""

    name = "grpo_mid"
    default_loss_mode = "clip"
    rounds: list[Round] = []  # what the test inspects

    @classmethod
    def validate(cls, config) -> None:
        super().validate(config)
        if config.num_generations != 2 * config.initial_rollouts:
            raise ValueError("APPOConfig: rollout_strategy=grpo_mid branches every root once: num_generations "
                             "must be 2 x initial_rollouts.")  # fmt: skip

    def generate(self, prompt_ids, n, seed, engine):
        roots = engine.run(engine.rollout(prompt_ids, self.args.initial_rollouts, seed=seed))
        requests = [(t, len(t.completion_ids) // 2) for group in roots for t in group]
        branches = iter(engine.run(engine.branch_many(requests, seed=seed + 1, resample=False)))
        groups = [list(group) + [next(branches) for _ in group] for group in roots]
        batch = Round(groups=groups, keep=[True] * (len(groups) * n))
        self.rounds.append(batch)
        return batch


@pytest.fixture
def fifth():
    register_strategy(MiddleBranchStrategy)  # the decorator, called
    MiddleBranchStrategy.rounds = []
    yield MiddleBranchStrategy
    STRATEGIES.pop(MiddleBranchStrategy.name)


def _config(tmp_path, **kw):
    return APPOConfig(output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=4, **{**CPU, **kw})


def test_an_unregistered_strategy_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"rollout_strategy='grpo_mid'; choose one of \("):
        _config(tmp_path, rollout_strategy="grpo_mid")


def test_the_fifth_strategy_is_a_config_value_with_its_own_check(fifth, tmp_path):
    cfg = _config(tmp_path, rollout_strategy="grpo_mid")
    assert cfg.strategy_class is fifth
    assert (cfg.initial_rollouts, cfg.loss_mode, cfg.drops_branch_rows) == (2, "clip", False)
    with pytest.raises(ValueError, match="branches every root once"):
        _config(tmp_path, rollout_strategy="grpo_mid", initial_rollouts=1)
    with pytest.raises(ValueError, match="dynamic_rollouts=True is an AEPO option"):
        _config(tmp_path, rollout_strategy="grpo_mid", dynamic_rollouts=True)


def test_the_fifth_strategy_trains_two_steps(fifth, tmp_path, tiny_tokenizer, tiny_model_path):
    from appo_trl.trainer.trainer import APPOTrainer

    def length_reward(completions, **kw):
        return [float(len(c[0]["content"]) % 5) for c in completions]

    prompts = [[{"role": "user", "content": f"what is {i} times 4"}] for i in range(8)]
    trainer = APPOTrainer(
        model=tiny_model_path,
        reward_funcs=[length_reward],
        args=_config(tmp_path, rollout_strategy="grpo_mid", max_steps=2, max_completion_length=12, temperature=1.0),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tiny_tokenizer,
    )
    assert (
        isinstance(trainer.strategy, fifth) and not trainer.sampling_path.trl_sampler
    )  # appo-trl's engine samples it
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.train()

    assert trainer.state.global_step == 2 and len(fifth.rounds) == 2
    for batch in fifth.rounds:
        for group in batch.groups:
            roots, branches = group[:2], group[2:]
            assert [t.parent for t in roots] == [None, None]
            assert [t.parent for t in branches] == [t.uid for t in roots]  # one branch per root, in order
            for root, branch in zip(roots, branches):
                mid = len(root.completion_ids) // 2
                assert branch.completion_ids[: mid + 1] == root.completion_ids[: mid + 1]  # token `mid` kept
    moved = any(not torch.equal(before[k], v) for k, v in trainer.model.named_parameters())
    assert moved
