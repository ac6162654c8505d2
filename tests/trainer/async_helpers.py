"""What the background-round tests share: a stand-in round, the GRPO settings and a copy of a model's weights."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Round:
    rows: list


GRPO = dict(tools=["python"], num_generations=4, per_device_train_batch_size=4, max_completion_length=64)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_one_step_stale(trainer, generated_on: list[str]) -> list[dict]:
    """A 4-step `max_staleness: 1` run: round 0 sampled on the trainer's thread, rounds 1-3 each one step stale on a
    round thread of its own; returns the logged steps."""
    hist = trainer.rounds.async_rounds.history
    assert [(h.step, h.version, h.staleness, h.background) for h in hist] == [
        (0, 0, 0, False), (1, 0, 1, True), (2, 1, 1, True), (3, 2, 1, True)
    ]  # fmt: skip
    assert generated_on == ["MainThread", "appo-round-0", "appo-round-1", "appo-round-2"]
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert [h["rollout/staleness/max"] for h in logs] == [0.0, 1.0, 1.0, 1.0]
    return logs


def loss_rows(seen: list[dict]) -> list[tuple[tuple, tuple]]:
    """(completion ids, tool mask) of every row the loss saw (`spy_loss`), each cut at its length (completion_mask:
    1 up to the row's last token)."""
    rows = []
    for s in seen:
        for ids, mask, valid in zip(s["completion_ids"].tolist(), s["tool_mask"].tolist(), s["completion_mask"]):
            n = int(valid.sum())
            rows.append((tuple(ids[:n]), tuple(mask[:n])))
    return rows
