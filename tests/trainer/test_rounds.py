"""The round runner (appo_trl.trainer.rounds): one `Round` per scoring call, and the old-logp reuse keyed on it.

Pinned: a `Round` serves its cached old logps only to TRL's ids of exactly its rows, once; in training, a no-grad
forward of the same shape on other rows runs the model while the round's own old-logp pass is still served from
APPO's selection forward (forwards counted); the reference forward is never served the policy's old logps when TRL
runs no old-logp pass; the round lives for one `_generate_and_score_completions` call only, exceptions included.
"""

from __future__ import annotations

import pytest
import torch

from appo_trl.strategies import Round
from appo_trl.trainer import tree
from tests.trainer.fakes import ScriptedEngine
from tests.trainer.test_trainer import RewardSpy, make_trainer

APPO = dict(tools=["python"], rollout_strategy="appo", initial_rollouts=2, num_generations=4,
            per_device_train_batch_size=4, max_steps=1, max_completion_length=64, min_remaining_tokens=4)  # fmt: skip


def trl_ids(prompts, completions, pad=0):
    """TRL's forward input: prompts left-padded, completions right-padded, concatenated; and `logits_to_keep`."""
    width, keep = max(map(len, prompts)), max(map(len, completions))
    rows = [[pad] * (width - len(p)) + p + c + [pad] * (keep - len(c)) for p, c in zip(prompts, completions)]
    return torch.tensor(rows), keep


def test_a_round_serves_its_old_logps_only_to_its_own_rows_once():
    prompts, completions = [[1, 2], [3]], [[4, 5, 6], [7]]
    cached = [torch.tensor([-0.1, -0.2, -0.3]), torch.tensor([-0.4])]
    rnd = Round(groups=[], keep=[], prompt_ids=prompts, completion_ids=completions, old_logps=list(cached))
    ids, keep = trl_ids(prompts, completions)
    other, _ = trl_ids(prompts, [[4, 5, 9], [7]])  # same shape, one token differs
    shifted, _ = trl_ids([[2], [3]], completions)  # same completions on another prompt
    assert other.shape == ids.shape
    assert rnd.take_old_logps(other, keep) is None and rnd.take_old_logps(shifted, keep) is None
    assert rnd.take_old_logps(ids, keep + 1) is None  # another split between prompt and completion
    out = rnd.take_old_logps(ids, keep)
    torch.testing.assert_close(out, torch.tensor([[-0.1, -0.2, -0.3], [-0.4, 0.0, 0.0]]))
    assert rnd.take_old_logps(ids, keep) is None  # once


def count_forwards(monkeypatch):
    """Every forward that reaches the model (the tree forward): (grad enabled, entropy, model) per call."""
    calls, real = [], tree.trainer_tree_forward

    def counting(trainer, model, input_ids, attention_mask, logits_to_keep, compute_entropy, **kw):
        calls.append((torch.is_grad_enabled(), compute_entropy, model))
        return real(trainer, model, input_ids, attention_mask, logits_to_keep, compute_entropy, **kw)

    monkeypatch.setattr(tree, "trainer_tree_forward", counting)
    return calls


def test_appo_old_logp_pass_is_served_by_the_selection_forward(tmp_path, tiny_tokenizer, tiny_model_path, monkeypatch):
    """num_iterations 2: TRL asks for old logps; the round's own pass never reaches the model, while a no-grad,
    entropy-free forward of the same shape on other rows (which the old shape guess served from the cache) does."""
    engine = ScriptedEngine(tiny_tokenizer, filler=12)
    trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, engine, RewardSpy(), num_iterations=2, **APPO)
    calls = count_forwards(monkeypatch)
    probes, generate = [], trainer._generate

    def generate_then_probe(prompts):
        out = generate(prompts)
        rnd = trainer.rounds.current
        assert rnd.old_logps is not None and len(rnd.old_logps) == len(rnd.rows) == 4
        completions = [c[:-1] + [c[0]] for c in rnd.completion_ids]  # the last token of every row changed
        ids, keep = trl_ids(rnd.prompt_ids, completions, tiny_tokenizer.pad_token_id)
        before = len(calls)
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), keep)
        probes.append((len(calls) - before, logps.size(0), rnd.old_logps is not None))
        return out

    trainer._generate = generate_then_probe
    trainer.train()
    assert probes == [(1, 4, True)]  # the probe ran the model; the round still held its old logps
    no_grad = [(grad, entropy) for grad, entropy, _ in calls if not grad]
    assert no_grad == [(False, True), (False, False)]  # APPO's selection forward, then the probe: no old-logp pass
    assert sum(grad for grad, _, _ in calls) == 1  # the loss forward (max_steps 1: the first iteration)


def test_reference_forward_is_never_served_the_old_logps(tmp_path, tiny_tokenizer, tiny_model_path, monkeypatch):
    """beta > 0, one iteration, in-process: TRL runs no old-logp pass, so its reference forward on the very same ids
    (no grad, no entropy; the old shape guess served it the policy's cached logps) runs the reference model."""
    engine = ScriptedEngine(tiny_tokenizer, filler=12)
    trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, engine, RewardSpy(), beta=0.04, **APPO)
    with torch.no_grad():
        for p in trainer.ref_model.parameters():
            p.mul_(0.5)  # a reference different from the policy
    calls = count_forwards(monkeypatch)
    seen, orig = [], trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: seen.append(orig(inputs)) or seen[-1]
    trainer.train()
    assert [m is trainer.ref_model for grad, entropy, m in calls if not grad and not entropy] == [True]
    out = seen[0]
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    att = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    with torch.no_grad():
        ref, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.ref_model, ids, att, out["completion_ids"].size(1)
        )
    mask = (out["completion_mask"] * out["tool_mask"]).bool()
    torch.testing.assert_close(out["ref_per_token_logps"][mask], ref[mask], atol=1e-4, rtol=1e-4)


def test_the_round_lives_for_one_scoring_call_even_when_it_fails(tmp_path, tiny_tokenizer, tiny_model_path):
    engine = ScriptedEngine(tiny_tokenizer, filler=12)
    trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, engine, RewardSpy(), num_iterations=2, **APPO)
    versions = []
    generate = trainer.rounds.generate

    def generate_and_fail(prompts):
        generate(prompts)
        versions.append((trainer.rounds.current.policy_version, trainer.rounds.current.mode))
        raise RuntimeError("reward server down")

    trainer.rounds.generate = generate_and_fail
    with pytest.raises(RuntimeError, match="reward server down"):
        trainer.train()
    assert versions == [(0, "train")] and trainer.rounds.current is None
    assert not any(k.startswith("_round") or k == "_old_logps_cache" for k in vars(trainer))
