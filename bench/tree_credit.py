"""Tree credit's cost per round, as a fraction of the training step (issue 39: it must stay negligible).

Workload (a) of `bench/tree_forward.py` (prompt 1,536 tokens, n = 16 rows of about 512 completion tokens, i.e. 16 rows
x 2,048 tokens, ARPO's tree: 8 roots and 8 branches that copy their parent up to the end of its first or second tool
result). One round here is one group (workload (a)'s generation batch per rank). Measured, in one process:

- `credit_ms`: the whole advantage step of `advantage_estimator: tree` for the round: `GroupTree.of` over the
  trajectories (lineage checked token by token) and `tree_credit` (median of `--repeats`);
- `step_s`: the tree forward's training step on the same rows (as `bench/tree_forward.py:measure`'s `step_s_tree`:
  TRL's no-grad old-logp pass, the loss forward and backward, an AdamW step; one run after a warm-up);
- `credit_fraction`: credit_ms / 1000 / step_s;
- `credit_ms_one_thread`, `credit_fraction_one_thread`: the same with torch on one thread. The estimator is ~30 small
  tensor ops on a (16, 512) grid; on a busy machine torch's intra-op threads spend more time synchronising than
  computing them, so the process's thread count can make it 10-50x slower than one thread.

`--quick` uses workload (a)'s scaled-down shape (`a_quick`). The figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.tree_forward import WORKLOADS, build_model, forward, group_rows, trl_layout  # noqa: E402


def arpo_group(prompt: int, n: int, comp: int, tool: int, vocab: int):
    """`group_rows("arpo", ...)` as `Trajectory` rows with their lineage (branch j of n − n/2 copies root j mod n/2
    up to the end of its first or second tool result, as `group_rows` builds it)."""
    from appo_trl.rollout.types import Trajectory

    rows = group_rows("arpo", prompt, n, comp, tool, vocab, seed=1)
    seg, roots = (comp - 2 * tool) // 3, n // 2
    out = []
    for i, (p, c) in enumerate(rows):
        t = Trajectory(prompt_ids=p, completion_ids=c, loss_mask=[1] * len(c), logprobs=[0.0] * len(c))
        if i >= roots:
            j = i - roots
            t.parent, t.origin = out[j % roots].uid, "fork"
            t.branch_pos = (seg + tool) if j % 2 == 0 else (2 * seg + 2 * tool)
        out.append(t)
    from appo_trl.rollout.group_tree import GroupTree

    assert sum(p >= 0 for p in GroupTree.of(out).parents) == n - roots, "every branch shares its parent's prefix"
    return rows, out


def credit_ms(trajectories, repeats: int) -> float:
    from types import SimpleNamespace

    from appo_trl.strategies import Round
    from appo_trl.strategies.credit import tree_advantages

    args = SimpleNamespace(
        advantage_estimator="tree",
        tree_credit_form="paper",
        tree_credit_global_weight=1.0,
        tree_credit_local_weight=1.0,
        tree_credit_scale="sqrt_rows",
    )
    rewards = torch.tensor([float(i % 3 == 0) for i in range(len(trajectories))])
    length = max(len(t.completion_ids) for t in trajectories)
    times = []
    for _ in range(repeats):
        batch = Round(groups=[trajectories], keep=[True] * len(trajectories))
        t0 = time.perf_counter()
        tree_advantages(batch, rewards, length, args)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def step_s(model, rows) -> float:
    """One training step through the tree forward (the second of two: the first warms up)."""
    ids, mask, c = trl_layout(rows)
    mask_c, adv = mask[:, -c:].float(), torch.randn(len(rows), 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    from appo_trl.tree.forward import PackCache

    packs, times = PackCache(), []
    for _ in range(2):
        t0 = time.perf_counter()
        with torch.no_grad():
            forward(model, ids, mask, c, True, entropy=False, packs=packs)
        logps, _ = forward(model, ids, mask, c, True, entropy=True, packs=packs)
        (-((logps * adv) * mask_c).sum() / mask_c.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[-1]


def figures(quick: bool, repeats: int) -> dict:
    workload = "a_quick" if quick else "a"
    prompt, n, comp, tool, hidden, layers, vocab = WORKLOADS[workload]
    rows, trajectories = arpo_group(prompt, n, comp, tool, vocab)
    ms = credit_ms(trajectories, repeats)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ms_one = credit_ms(trajectories, repeats)
    torch.set_num_threads(threads)
    model = build_model(hidden, layers, vocab, prompt + comp + 8)
    step = step_s(model, rows)
    tokens = sum(len(p) + len(c) for p, c in rows)
    return {"workload": workload, "rows": n, "row_tokens": tokens, "credit_ms": ms, "step_s": step,
            "credit_fraction": ms / 1e3 / step, "threads": threads, "credit_ms_one_thread": ms_one,
            "credit_fraction_one_thread": ms_one / 1e3 / step}  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="workload (a) scaled down (prompt 192, completion 64)")
    ap.add_argument("--json", action="store_true", help="print one JSON object of the figures as the last line")
    ap.add_argument("--repeats", type=int, default=20, help="timed runs of the estimator (median)")
    opts = ap.parse_args(argv)
    if opts.repeats < 1:
        ap.error(f"--repeats {opts.repeats} must be >= 1")
    out = figures(opts.quick, opts.repeats)
    for k, v in out.items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    if opts.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
