"""APPOTrainer wiring on the tiny model with a scripted rollout engine (tests/trainer/fakes.py).

What is pinned: n rows per group reach the rewards; tool tokens are masked; only initial rows reach the loss
(APPO); `num_items_in_batch` equals the global mask sum of the rows that reach the loss; the advantages the
loss sees are those of `appo_dual_group_advantages` on the rewards the reward function returned; the custom
loss path reproduces TRL's loss and normaliser; parameters move.
"""

from __future__ import annotations

import torch
from datasets import Dataset

from appo_trl.config import APPOConfig
from appo_trl.trainer.trainer import APPOTrainer
from tests.trainer.fakes import ScriptedEngine

CPU = dict(
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
    report_to="none",
    save_strategy="no",
    logging_steps=1,
    learning_rate=1e-2,
    beta=0.0,
    seed=0,
    loss_type="dapo",
)


def dataset(k=8):
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"what is {i} times 4"}] for i in range(k)],
            "answer": [str(i % 3) for i in range(k)],
        }
    )


class RewardSpy:
    __name__ = "answer_reward"

    def __init__(self):
        self.calls = []

    def __call__(self, completions, answer, num_tool_calls, **kw):
        texts = [c[0]["content"] for c in completions]
        rewards = [
            float(f"<answer> {a} </answer>" in t or f"<answer>{a}</answer>" in t) + 0.1 * len(t) / 100
            for t, a in zip(texts, answer)
        ]
        self.calls.append({"texts": texts, "num_tool_calls": list(num_tool_calls), "rewards": rewards})
        return rewards


def make_trainer(tmp_path, tokenizer, model_path, engine, reward, **kw):
    args = APPOConfig(output_dir=str(tmp_path), **{**CPU, **kw})
    return APPOTrainer(
        model=model_path,
        reward_funcs=[reward],
        args=args,
        train_dataset=dataset(),
        processing_class=tokenizer,
        rollout_engine=engine,
    )


def spy_loss(trainer):
    seen = []
    orig = trainer._compute_loss

    def wrapped(model, inputs):
        seen.append({k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()})
        return orig(model, inputs)

    trainer._compute_loss = wrapped
    return seen


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _result_token_count(tokenizer, ids):
    """Tokens of the `<result> … </result>` span in a completion (the tool output)."""
    start, end = tokenizer.convert_tokens_to_ids("<result>"), tokenizer.convert_tokens_to_ids("</result>")
    ids = ids.tolist()
    return ids.index(end) - ids.index(start) + 1 if start in ids else 0


def test_grpo_tool_loop_rows_masks_and_normaliser(tmp_path, tiny_tokenizer, tiny_model_path):
    engine, reward = ScriptedEngine(tiny_tokenizer), RewardSpy()
    trainer = make_trainer(
        tmp_path,
        tiny_tokenizer,
        tiny_model_path,
        engine,
        reward,
        tools=["python"],
        num_generations=4,
        per_device_train_batch_size=4,
        max_steps=2,
        max_completion_length=64,
    )
    seen = spy_loss(trainer)
    before = _params(trainer.model)
    trainer.train()
    assert engine.rollout_calls == [(1, 4), (1, 4)]  # one unique prompt, n rollouts, per round
    assert all(len(c["texts"]) == 4 for c in reward.calls) and len(reward.calls) == 2
    assert all(c["num_tool_calls"] == [1, 1, 1, 1] for c in reward.calls)
    for inputs in seen:
        mask = inputs["completion_mask"] * inputs["tool_mask"]
        assert int(inputs["num_items_in_batch"]) == int(mask.sum())
        for row in range(mask.size(0)):
            zeros = int((inputs["completion_mask"][row] * (1 - inputs["tool_mask"][row])).sum())
            assert zeros == _result_token_count(tiny_tokenizer, inputs["completion_ids"][row]) > 0
    after = _params(trainer.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    logged = {k for e in trainer.state.log_history for k in e}
    assert {"tools/call_frequency", "rollout/sampled_tokens", "completions/mean_length"} <= logged


def test_appo_only_initial_rows_reach_the_loss_with_dual_group_advantages(
    tmp_path, tiny_tokenizer, tiny_model_path, monkeypatch
):
    import appo_trl.algorithms.advantages as adv_mod

    produced = []
    real = adv_mod.appo_dual_group_advantages

    def spy(**kw):
        out = real(**kw)
        produced.append({"rewards": torch.cat([kw["initial_rewards"], kw["branch_rewards"]], 1).clone(), "adv": out})
        return out

    monkeypatch.setattr(adv_mod, "appo_dual_group_advantages", spy)
    engine, reward = ScriptedEngine(tiny_tokenizer, filler=12), RewardSpy()
    # 2 groups of n = 4 per round (N = 2 initial), split into 2 micro-batches of 2 kept rows
    trainer = make_trainer(
        tmp_path,
        tiny_tokenizer,
        tiny_model_path,
        engine,
        reward,
        tools=["python"],
        rollout_strategy="appo",
        initial_rollouts=2,
        num_generations=4,
        per_device_train_batch_size=4,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        max_steps=1,
        max_completion_length=64,
        min_remaining_tokens=4,
    )
    seen = spy_loss(trainer)
    before = _params(trainer.model)
    trainer.train()
    assert engine.rollout_calls == [(2, 2)]  # N initial rollouts per unique prompt
    assert len(engine.branch_requests) == 2 * 2  # n - N branches per prompt
    assert len(reward.calls) == 1 and len(reward.calls[0]["texts"]) == 8  # all n rows scored
    # rewards the advantage function saw == rewards returned, in group order
    got = torch.tensor(reward.calls[0]["rewards"]).view(2, 4)
    assert torch.allclose(produced[0]["rewards"], got)
    assert len(seen) == 2 and all(s["completion_ids"].size(0) == 2 for s in seen)
    adv = produced[0]["adv"]  # (G·N, T), row k = engine.initial[k]
    assert adv.size(0) == len(engine.initial) == 4
    total_mask = sum(int((s["completion_mask"] * s["tool_mask"]).sum()) for s in seen)
    matched = []
    for s in seen:
        assert int(s["num_items_in_batch"]) == total_mask  # global mask sum of the rows that reach the loss
        for row in range(s["completion_ids"].size(0)):
            ids = s["completion_ids"][row][s["completion_mask"][row].bool()].tolist()
            prompt = s["prompt_ids"][row][s["prompt_mask"][row].bool()].tolist()
            k = [k for k, t in enumerate(engine.initial) if t.completion_ids == ids and t.prompt_ids == prompt]
            assert len(k) == 1, "a row that reached the loss is not an initial rollout"
            matched.append(k[0])
            width = min(adv.size(1), s["advantages"].size(1))
            assert torch.allclose(s["advantages"][row, :width], adv[k[0], :width].to(s["advantages"]))
    assert sorted(matched) == [0, 1, 2, 3]
    after = _params(trainer.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    logged = {k for e in trainer.state.log_history for k in e}
    assert {"branch/points_per_prompt", "branch/rows_dropped", "branch/bs_mean"} <= logged


def test_custom_loss_path_matches_trl_loss_and_normaliser(tmp_path, tiny_tokenizer, tiny_model_path, monkeypatch):
    from trl import GRPOTrainer

    from appo_trl.trainer.loss import compute_policy_loss

    engine, reward = ScriptedEngine(tiny_tokenizer), RewardSpy()
    trainer = make_trainer(
        tmp_path,
        tiny_tokenizer,
        tiny_model_path,
        engine,
        reward,
        tools=["python"],
        num_generations=4,
        per_device_train_batch_size=4,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        max_steps=1,
        max_completion_length=64,
    )
    seen = spy_loss(trainer)
    trainer.train()
    inputs = seen[0]
    trainer.model.train()
    for loss_type in ("dapo", "grpo", "bnpo", "dr_grpo"):
        trainer.args.loss_type = trainer.loss_type = loss_type
        ref = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
        ours = compute_policy_loss(trainer, trainer.model, inputs)
        assert torch.allclose(ref, ours, atol=1e-6), (loss_type, ref, ours)
        assert ref.abs() > 0
    # the KL term (APPO recipes: beta = 0.001) is TRL's k3 with its bias correction, added the same way
    gen = torch.Generator().manual_seed(0)
    inputs["ref_per_token_logps"] = -torch.rand(inputs["completion_ids"].shape, generator=gen) * 3
    trainer.args.loss_type = trainer.loss_type = "dapo"
    without_kl = compute_policy_loss(trainer, trainer.model, inputs)
    trainer.beta = trainer.args.beta = 0.05
    ref = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    ours = compute_policy_loss(trainer, trainer.model, inputs)
    assert torch.allclose(ref, ours, atol=1e-6), (ref, ours)
    assert not torch.allclose(ours, without_kl)
    assert trainer._metrics["train"]["kl"][-1] > 0


def test_appo_reuses_the_branch_selection_forward_as_old_logps(tmp_path, tiny_tokenizer, tiny_model_path, monkeypatch):
    from trl import GRPOTrainer

    engine, reward = ScriptedEngine(tiny_tokenizer, filler=12), RewardSpy()
    # num_iterations = 2 makes TRL ask for old logps; GA = 1 so the first loss call sees θ_old
    trainer = make_trainer(
        tmp_path,
        tiny_tokenizer,
        tiny_model_path,
        engine,
        reward,
        tools=["python"],
        rollout_strategy="appo",
        initial_rollouts=2,
        num_generations=4,
        num_iterations=2,
        per_device_train_batch_size=4,
        max_steps=1,
        max_completion_length=64,
        min_remaining_tokens=4,
        learning_rate=0.0,
    )  # θ stays θ_old, so the reference forward below is θ_old's
    full_batch_forwards = []
    real_forward = GRPOTrainer._get_per_token_logps_and_entropies

    def counting(self, model, input_ids, *a, **kw):
        if not torch.is_grad_enabled() and not kw.get("compute_entropy", False):
            full_batch_forwards.append(input_ids.size(0))
        return real_forward(self, model, input_ids, *a, **kw)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", counting)
    seen = spy_loss(trainer)
    trainer.train()
    assert full_batch_forwards == []  # TRL's old-logp pass on all n rows was served from the cache
    first = seen[0]
    assert "old_per_token_logps" in first
    ids = torch.cat([first["prompt_ids"], first["completion_ids"]], 1)
    att = torch.cat([first["prompt_mask"], first["completion_mask"]], 1)
    with torch.no_grad():
        ref, _, _ = real_forward(trainer, trainer.model, ids, att, first["completion_ids"].size(1))
    mask = (first["completion_mask"] * first["tool_mask"]).bool()
    assert torch.allclose(first["old_per_token_logps"][mask], ref[mask], atol=1e-4)


def test_aepo_entropy_aware_advantage_is_applied_with_trainer_entropies(
    tmp_path, tiny_tokenizer, tiny_model_path, monkeypatch
):
    import appo_trl.algorithms.advantages as adv_mod
    from appo_trl.trainer.loss import compute_policy_loss

    calls = []
    real = adv_mod.entropy_aware_advantage

    def spy(advantages, entropies, mask, *, weight, **kw):
        calls.append((entropies.clone(), weight, entropies.requires_grad))
        return real(advantages, entropies, mask, weight=weight, **kw)

    monkeypatch.setattr(adv_mod, "entropy_aware_advantage", spy)
    engine, reward = ScriptedEngine(tiny_tokenizer), RewardSpy()
    trainer = make_trainer(
        tmp_path,
        tiny_tokenizer,
        tiny_model_path,
        engine,
        reward,
        tools=["python"],
        rollout_strategy="aepo",
        initial_rollouts=4,
        num_generations=4,
        per_device_train_batch_size=4,
        loss_mode="entropy_balanced",
        entropy_balanced_advantage=True,
        entropy_advantage_weight=0.5,
        max_steps=1,
        max_completion_length=64,
    )
    assert trainer._custom_loss and trainer.args.loss_mode == "entropy_balanced"
    seen = spy_loss(trainer)
    trainer.train()
    assert calls and calls[0][1] == 0.5 and calls[0][2] is False  # exact entropies, detached, every step
    assert calls[0][0].abs().sum() > 0
    # the reweighting changes the loss: compare with the flag off on the same batch
    trainer.model.train()
    with_flag = compute_policy_loss(trainer, trainer.model, seen[0])
    trainer.args.entropy_balanced_advantage = False
    without = compute_policy_loss(trainer, trainer.model, seen[0])
    assert not torch.allclose(with_flag, without)


def test_reward_names_resolve_through_the_registry(tmp_path, tiny_tokenizer, tiny_model_path):
    from appo_trl.rewards import REWARD_FUNCS

    name = sorted(REWARD_FUNCS)[0]
    args = APPOConfig(output_dir=str(tmp_path), **{**CPU, "num_generations": 4, "per_device_train_batch_size": 4})
    trainer = APPOTrainer(
        model=tiny_model_path, reward_funcs=[name], args=args, train_dataset=dataset(), processing_class=tiny_tokenizer
    )
    assert trainer.reward_funcs[0] is REWARD_FUNCS[name]


def test_engine_is_built_from_the_config(tmp_path, tiny_tokenizer, tiny_model_path):
    from appo_trl.rollout import RolloutEngine, TransformersBackend

    args = APPOConfig(
        output_dir=str(tmp_path),
        **{**CPU, "num_generations": 4, "per_device_train_batch_size": 4},
        tools=["python"],
        tool_call_limit=5,
        rollout_strategy="appo",
        initial_rollouts=2,
        max_completion_length=48,
        entropy_topk=7,
    )
    trainer = APPOTrainer(
        model=tiny_model_path,
        reward_funcs=[RewardSpy()],
        args=args,
        train_dataset=dataset(),
        processing_class=tiny_tokenizer,
    )
    assert not trainer.sampling_path.trl_sampler
    engine = trainer.rollout_engine
    try:
        assert isinstance(engine, RolloutEngine) and isinstance(engine.backend, TransformersBackend)
        cfg = engine.config
        assert (cfg.call_limit, cfg.max_completion_length, cfg.entropy_topk, cfg.record_entropies) == (5, 48, 7, True)
        assert cfg.tool_tags == ["python"]
    finally:
        engine.close()
