"""Padding rows of `add_chain_rows` under several processes: a rank with fewer chain rows than the busiest runs its
forwards on rows of pad tokens only, and they leave nothing in its batch.

Two ranks are faked on one process: `num_processes` reads 2 and `gather` returns this rank's chain-row count beside
the other rank's. The scored batch is TRL's layout for two runs, written by hand; the forwards are the tiny model's,
one row at a time (per-device batch 1), so a row's logps do not depend on the rows beside it.
"""

from __future__ import annotations

import pytest
import torch

from appo_trl.config import APPOConfig
from appo_trl.rollout.types import Trajectory
from appo_trl.trainer.chain_rows import add_chain_rows, padding_rows
from appo_trl.trainer.trainer import APPOTrainer
from tests.trainer.test_trainer import CPU, RewardSpy, dataset


@pytest.fixture
def trainer(tmp_path, tiny_tokenizer, tiny_model_path):
    args = APPOConfig(output_dir=str(tmp_path), **{**CPU, "beta": 0.04}, num_generations=2,
                      per_device_train_batch_size=1, per_device_eval_batch_size=1, gradient_accumulation_steps=2)  # fmt: skip
    return APPOTrainer(model=tiny_model_path, reward_funcs=[RewardSpy()], args=args, train_dataset=dataset(),
                       processing_class=tiny_tokenizer)  # fmt: skip


def spy_forwards(trainer):
    """(input ids, attention mask, logits_to_keep) of every forward the trainer runs from here on."""
    seen, real = [], trainer._get_per_token_logps_and_entropies

    def spy(model, input_ids, attention_mask, logits_to_keep, *a, **k):
        seen.append((input_ids.clone(), attention_mask.clone(), logits_to_keep))
        return real(model, input_ids, attention_mask, logits_to_keep, *a, **k)

    trainer._get_per_token_logps_and_entropies = spy
    return seen


def two_ranks(monkeypatch, trainer, other: int):
    """This process as one of 2 ranks; the other rank holds `other` chain rows."""
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 2))
    monkeypatch.setattr(trainer.accelerator, "gather", lambda t: torch.cat([t, torch.tensor([other]).to(t)]))


def scored_batch(pad: int) -> dict:
    """TRL's scored batch of two runs: prompts of 2 and 3 tokens (left-padded), completions of 3 and 2 (right)."""
    return {
        "prompt_ids": torch.tensor([[pad, 11, 12], [13, 14, 15]]),
        "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
        "completion_ids": torch.tensor([[21, 22, 23], [24, 25, pad]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        "tool_mask": torch.tensor([[1, 0, 1], [1, 1, 1]]),
        "advantages": torch.tensor([0.5, -0.5]),
        "sampling_per_token_logps": torch.tensor([[-0.1, -0.2, -0.3], [-0.4, -0.5, 0.0]]),
        "old_per_token_logps": torch.tensor([[-1.0, -1.1, -1.2], [-1.3, -1.4, 0.0]]),
        "ref_per_token_logps": torch.tensor([[-1.0, -1.2, -1.4], [-1.3, -1.5, 0.0]]),
        "num_items_in_batch": torch.tensor(7.0),
    }


def runs(chain: Trajectory | None) -> list[Trajectory]:
    """The batch's two runs; the second has `chain` as its one chain row (none when None)."""
    first = Trajectory(prompt_ids=[11, 12], completion_ids=[21, 22, 23], loss_mask=[1, 0, 1])
    second = Trajectory(prompt_ids=[13, 14, 15], completion_ids=[24, 25], loss_mask=[1, 1])
    second.chain_rows = [] if chain is None else [chain]
    return [first, second]


CHAIN = Trajectory(prompt_ids=[31, 32, 33, 34], completion_ids=[41, 42, 43, 44, 45], loss_mask=[1, 1, 0, 0, 1],
                   logprobs=[-0.25, -0.5, 0.0, 0.0, -0.75])  # fmt: skip


def clone(batch: dict) -> dict:
    return {k: v.clone() for k, v in batch.items()}


def test_padding_rows_are_pad_tokens_in_no_mask():
    assert padding_rows(2, 0) == {"prompt_ids": [[0], [0]], "completion_ids": [[0], [0]],
                                  "completion_mask": [[0], [0]], "tool_mask": [[0], [0]],
                                  "sampling_per_token_logps": [[0.0], [0.0]]}  # fmt: skip
    assert padding_rows(0, 5) == {k: [] for k in padding_rows(2, 0)}


def test_a_rank_without_chain_rows_runs_the_forwards_on_padding_rows_only(monkeypatch, trainer, tiny_tokenizer):
    """The other rank has 2 chain rows: this one runs the old-logp and reference forwards on 2 padding rows (one pad
    prompt token attended, one pad completion token), and hands back TRL's batch and `keep` unchanged."""
    pad = tiny_tokenizer.pad_token_id
    out, keep = scored_batch(pad), [True, False]
    before = clone(out)
    seen = spy_forwards(trainer)
    two_ranks(monkeypatch, trainer, other=2)
    got, got_keep = add_chain_rows(trainer, out, runs(None), keep)
    assert got is out and got.keys() == before.keys() and all(torch.equal(got[k], before[k]) for k in before)
    assert got_keep == [True, False] and got_keep is not keep
    assert len(seen) == 2  # old logps, then the reference's
    for ids, mask, width in seen:
        assert ids.tolist() == [[pad, pad], [pad, pad]] and mask.tolist() == [[1, 0], [1, 0]] and width == 1


def test_padding_rows_add_nothing_to_a_ranks_batch_loss_or_gradient(monkeypatch, trainer, tiny_tokenizer):
    """1 chain row here, 3 on the other rank: the batch (every entry, exactly), its loss and its gradient are those of
    one process; the forwards saw the chain row and 2 rows of pad tokens, none of the chain row's tokens."""
    pad = tiny_tokenizer.pad_token_id
    assert pad not in CHAIN.prompt_ids + CHAIN.completion_ids
    alone, alone_keep = add_chain_rows(trainer, scored_batch(pad), runs(CHAIN), [True, False])
    seen = spy_forwards(trainer)
    with monkeypatch.context() as m:
        two_ranks(m, trainer, other=3)
        padded, padded_keep = add_chain_rows(trainer, scored_batch(pad), runs(CHAIN), [True, False])
    # by hand: the chain row joins as row 2, prompt left-padded to 4, completion of 5; its run (row 1) gives -0.5
    assert padded_keep == alone_keep == [True, False, False]
    assert padded["prompt_ids"][2].tolist() == [31, 32, 33, 34] and padded["prompt_ids"][0].tolist() == [pad] * 2 + [
        11, 12]  # fmt: skip
    assert padded["completion_ids"][2].tolist() == [41, 42, 43, 44, 45]
    assert padded["completion_mask"][2].tolist() == [1] * 5 and padded["tool_mask"][2].tolist() == [1, 1, 0, 0, 1]
    assert padded["sampling_per_token_logps"][2].tolist() == [-0.25, -0.5, 0.0, 0.0, -0.75]
    assert padded["advantages"].tolist() == [0.5, -0.5, -0.5] and padded["num_items_in_batch"].item() == 7.0
    assert padded.keys() == alone.keys()
    for k in alone:
        assert padded[k].shape == alone[k].shape and torch.equal(padded[k], alone[k]), k
    # what the forwards saw: the chain row, then 2 rows of one attended pad token and one masked pad completion
    assert len(seen) == 2
    for ids, mask, width in seen:
        assert ids.shape == (3, 9) and width == 5
        assert ids[0].tolist() == CHAIN.prompt_ids + CHAIN.completion_ids and mask[0].tolist() == [1] * 9
        assert ids[1:].eq(pad).all() and mask[1:].tolist() == [[0, 0, 0, 1, 0, 0, 0, 0, 0]] * 2
    losses, grads = [], []
    for batch in (alone, padded):
        trainer.model.zero_grad()
        loss = trainer._compute_loss(trainer.model, batch)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in trainer.model.parameters() if p.grad is not None])
    assert torch.isfinite(losses[0]) and torch.equal(losses[0], losses[1])
    assert grads[0] and len(grads[0]) == len(grads[1]) and all(torch.equal(a, b) for a, b in zip(*grads))
