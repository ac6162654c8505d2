"""2-process APPO run for tests/trainer/test_distributed.py: `torchrun --nproc_per_node 2 ddp_appo.py MODEL OUT`.

Each rank branches its own group (scripted engine), drops branch rows, and checks that `num_items_in_batch`
is the global mask sum of the rows that reach the loss; rank 0 writes `ok` when both ranks agree.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from tests.trainer.fakes import ScriptedEngine  # noqa: E402
from tests.trainer.test_trainer import RewardSpy, make_trainer  # noqa: E402


def main(model_path, out):
    tok = AutoTokenizer.from_pretrained(model_path)
    engine = ScriptedEngine(tok, filler=8)
    trainer = make_trainer(
        out,
        tok,
        model_path,
        engine,
        RewardSpy(),
        tools=["python"],
        rollout_strategy="appo",
        initial_rollouts=2,
        num_generations=4,
        per_device_train_batch_size=4,
        max_steps=2,
        max_completion_length=64,
        min_remaining_tokens=4,
    )
    seen = []
    orig = trainer._compute_loss
    trainer._compute_loss = lambda m, i: (
        seen.append(
            (
                int(i["num_items_in_batch"]),
                int((i["completion_mask"] * i["tool_mask"]).sum()),
                i["completion_ids"].size(0),
            )
        )
        or orig(m, i)
    )
    trainer.train()
    local = torch.tensor([s[1] for s in seen], dtype=torch.long)
    total = local.clone()
    dist.all_reduce(total)
    assert all(rows == 2 for _, _, rows in seen), seen
    assert [s[0] for s in seen] == total.tolist(), (seen, total)
    assert engine.rollout_calls == [(1, 2), (1, 2)]
    if dist.get_rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"ok": True, "seen": seen, "global": total.tolist(), "world": dist.get_world_size()}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
