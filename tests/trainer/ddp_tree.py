"""2-process (gloo, CPU) run with the tree forward, for tests/trainer/test_tree_trainer.py:
`torchrun --nproc_per_node 2 ddp_tree.py MODEL OUT`.

Each rank trains one ARPO step through DDP with `tree_forward` on, and inside the step compares its micro-batches'
loss and gradients row-wise and through the tree; rank 0 writes the largest differences of both ranks.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from tests.trainer.test_tree_trainer import run_one_step  # noqa: E402


def main(model_path, out):
    tok = AutoTokenizer.from_pretrained(model_path)
    trainer, _, seen, compared = run_one_step(
        out, tok, model_path, compare=True, rollout_strategy="arpo", initial_rollouts=2
    )
    loss_diff = max(abs(float(c[True][0] - c[False][0])) for c in compared)
    grad_diff = max(float((c[True][1][n] - c[False][1][n]).abs().max()) for c in compared for n in c[False][1])
    diffs = torch.tensor([loss_diff, grad_diff, float(len(compared))])
    gathered = [torch.zeros(3) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, diffs)
    if dist.get_rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"world": dist.get_world_size(), "diffs": [g.tolist() for g in gathered],
                       "ddp": type(trainer.model_wrapped).__name__}, f)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
