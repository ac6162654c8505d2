"""What the background-round tests share: a stand-in round, the GRPO settings and a copy of a model's weights."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Round:
    rows: list


GRPO = dict(tools=["python"], num_generations=4, per_device_train_batch_size=4, max_completion_length=64)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
