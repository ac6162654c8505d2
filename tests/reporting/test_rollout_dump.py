"""Rollout dumps: a step that is re-run (after a kill and a resume) replaces its file (issue 21)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from appo_trl.reporting.rollout_dump import dump_round, read_dumps
from appo_trl.rollout.types import Trajectory
from appo_trl.strategies import Round


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _trainer(out, step):
    args = SimpleNamespace(dump_rollouts=1, output_dir=str(out), rollout_strategy="grpo")
    return SimpleNamespace(
        args=args, accelerator=SimpleNamespace(is_main_process=True), state=SimpleNamespace(global_step=step),
        processing_class_tokenizer=_Tok(),
    )  # fmt: skip


def _round(first_token):
    rows = [Trajectory(prompt_ids=[1], completion_ids=[first_token, 7], loss_mask=[1, 1], logprobs=[0.0, 0.0])]
    batch = Round(groups=[rows], keep=[True])
    out = {"advantages": torch.zeros(1), "completion_mask": torch.ones(1, 2)}
    return [{"prompt": "p", "answer": "a"}], batch, torch.ones(1), out


def test_rerun_step_replaces_the_killed_runs_records(tmp_path):
    killed = _trainer(tmp_path, step=2)  # the killed run dumped step 3, then died before its checkpoint
    path = dump_round(killed, *_round(11))
    assert path.name == "step_000003.jsonl"
    resumed = _trainer(tmp_path, step=2)  # resumed from checkpoint-2: step 3 runs again
    dump_round(resumed, *_round(22))
    step, groups = read_dumps(tmp_path, 3)
    assert [g["rows"][0]["completion"] for g in groups] == ["22 7"]  # only the re-run's record
    dump_round(resumed, *_round(33))  # a second round of the same step in the same run is kept beside it
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [g["rows"][0]["completion"] for g in lines] == ["22 7", "33 7"]
