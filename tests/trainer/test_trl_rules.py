"""TRL's copied rules (`appo_trl.trl_rules`) on hand-computed numbers, and the one left-pad helper."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from appo_trl import trl_rules
from appo_trl.trainer import trl_seams
from appo_trl.trainer.rows import left_pad


def test_one_version_stamp():
    assert trl_seams.TRL_VERSION is trl_rules.TRL_VERSION == "1.16.0"


def ratio_trainer(mode, lo, hi):
    return SimpleNamespace(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=lo,
                           vllm_importance_sampling_clip_max=hi)  # fmt: skip


OLD, SAMPLING = torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.5, -1.0, -9.0]])
MASK = torch.tensor([[1, 1, 0]])  # the third token is a tool result: out of the ratio


@pytest.mark.parametrize(
    "mode, lo, hi, expected",
    [
        ("token_truncate", None, 10.0, [math.exp(0.5), math.exp(-1.0), 1.0]),  # diff 0.5, -1.0, masked 0
        ("token_truncate", 0.5, 1.5, [1.5, 0.5, 1.0]),
        ("token_mask", 0.5, 1.5, [0.0, 0.0, 1.0]),  # outside [0.5, 1.5]: 0
        ("sequence_truncate", 0.7, 2.0, [0.7]),  # exp(0.5 - 1.0) = 0.607, clamped
        ("sequence_mask", 0.5, 2.0, [math.exp(-0.5)]),
        ("sequence_mask", 0.7, 2.0, [0.0]),
    ],
)
def test_importance_ratio(mode, lo, hi, expected):
    got = trl_rules.importance_ratio(ratio_trainer(mode, lo, hi), OLD, SAMPLING, MASK)
    assert got.tolist()[0] == pytest.approx(expected)


def test_truncated_rows():
    trainer = SimpleNamespace(eos_token_ids=[2], _tokenizer=SimpleNamespace(pad_token_id=0))
    cut = trl_rules.truncated_rows(trainer, [[5, 2], [5, 7], [5, 0]])
    assert cut.tolist() == [[False], [True], [False]]  # ends in EOS, cut short, ends in pad


@pytest.mark.parametrize(
    "accumulation, vllm, correction, runs",
    [(2, False, True, False), (3, False, False, True), (2, True, True, True), (2, True, False, False)],
)
def test_runs_old_logp_pass(accumulation, vllm, correction, runs):
    args = SimpleNamespace(steps_per_generation=2, num_iterations=1, gradient_accumulation_steps=accumulation)
    trainer = SimpleNamespace(args=args, use_vllm=vllm, vllm_importance_sampling_correction=correction)
    assert trl_rules.runs_old_logp_pass(trainer) is runs


def test_reference_logps_uses_the_reference_model():
    ref, policy = object(), object()
    trainer = SimpleNamespace(ref_model=ref, model=policy)
    assert trl_rules.reference_logps(trainer, lambda m: "ref" if m is ref else "policy") == "ref"


def test_left_pad_as_trl_pads_prompts():
    ids, mask = left_pad([[1, 2], [3]], pad_id=0)
    assert ids.tolist() == [[1, 2], [0, 3]] and mask.tolist() == [[1, 1], [0, 1]]
    assert ids.dtype == mask.dtype == torch.long


@pytest.mark.parametrize("copy", sorted(trl_rules.TRL_COPIES))
def test_the_trl_source_each_rule_copies_is_the_one_it_was_read_from(copy):
    import hashlib
    import importlib
    import inspect

    where, sha = trl_rules.TRL_COPIES[copy]
    module, qualname = where.split(":")
    obj = importlib.import_module(module)
    for name in qualname.split("."):
        obj = getattr(obj, name)
    source = inspect.getsource(obj)
    got = hashlib.sha256(source.encode()).hexdigest()
    assert got == sha, (f"trl_rules.{copy} copies {where} of trl {trl_rules.TRL_VERSION}, whose source has changed: "
                        f"read it again, update the copy, then its hash ({got})")  # fmt: skip


def test_extend_scored_batch_pads_as_trl_pads():
    # prompts left-padded with the pad token (9), completions right-padded (ids with the pad, masks with 0 / 1)
    out = {"prompt_ids": torch.tensor([[1, 2]]), "prompt_mask": torch.tensor([[1, 1]]),
           "completion_ids": torch.tensor([[3]]), "completion_mask": torch.tensor([[1]]),
           "tool_mask": torch.tensor([[1]]), "advantages": torch.tensor([0.5]), "num_items_in_batch": 7}  # fmt: skip
    new = {"prompt_ids": torch.tensor([[4]]), "prompt_mask": torch.tensor([[1]]),
           "completion_ids": torch.tensor([[5, 6]]), "completion_mask": torch.tensor([[1, 1]]),
           "tool_mask": torch.tensor([[1, 0]]), "advantages": torch.tensor([-1.0])}  # fmt: skip
    got = trl_rules.extend_scored_batch(out, new, pad_id=9)
    assert got["prompt_ids"].tolist() == [[1, 2], [9, 4]] and got["prompt_mask"].tolist() == [[1, 1], [0, 1]]
    assert got["completion_ids"].tolist() == [[3, 9], [5, 6]]
    assert got["completion_mask"].tolist() == [[1, 0], [1, 1]] and got["tool_mask"].tolist() == [[1, 1], [1, 0]]
    assert got["advantages"].tolist() == [0.5, -1.0] and got["num_items_in_batch"] == 7
    with pytest.raises(RuntimeError, match=r"entries \['new_entry'\]"):
        trl_rules.check_extendable({**out, "new_entry": torch.zeros(1, 3)}, 1)


def test_log_generation_under_trls_keys():
    from collections import defaultdict

    trainer, m = SimpleNamespace(state=SimpleNamespace(num_input_tokens_seen=10)), defaultdict(list)
    lengths, truncated = torch.tensor([4, 2, 6]), torch.tensor([False, True, False])
    trl_rules.log_generation(trainer, "train", m, torch.tensor(20), lengths, truncated)
    assert trainer.state.num_input_tokens_seen == 30 and m["num_tokens"] == [30]
    assert (m["completions/mean_length"], m["completions/min_length"], m["completions/max_length"]) == ([4.0], [2.0],
                                                                                                      [6.0])  # fmt: skip
    assert m["completions/clipped_ratio"] == [pytest.approx(1 / 3)]
    assert (m["completions/mean_terminated_length"], m["completions/min_terminated_length"]) == ([5.0], [4.0])
    trl_rules.log_generation(trainer, "eval", m, torch.tensor(5), lengths, torch.tensor([True] * 3))
    assert trainer.state.num_input_tokens_seen == 30 and m["completions/max_terminated_length"][-1] == 0.0
