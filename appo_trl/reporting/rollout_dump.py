"""Sample trajectories of a training run, written as JSON lines and read back as branch trees.

With `dump_rollouts: K` the trainer writes the first K groups of every training round on the main process to
`output_dir/rollouts/step_<N>.jsonl` (N = the optimizer step the round trains), one JSON object per group:

    {"step", "group", "strategy", "prompt", "answer",
     "rows": [{"index", "uid", "parent" (row index or null), "origin" (lineage: root | fork | refill | branch | restart), "role" (sample | chain),
               "branch_pos" (tokens shared with the parent), "fork_context" (text just before the fork),
               "reward", "advantage" (mean over the row's tokens), "kept" (reaches the loss),
               "advantage_runs": [[start, end, value], ...] (covering [0, length): the advantage each token
                   carries into the loss, masked tokens included; AEPO's entropy-aware factor applies on top),
               "node_runs": [[start, end, V, rows], ...] (tree credit only: V of the deepest node holding the
                   token and how many rows hold it; else null),
               "num_calls", "tool_calls": [{"tag", "query", "ok", "result"}], "finish_reason", "length",
               "completion", "continuation" (a branch's text after its fork, else null)}]}

`parent` and `branch_pos` are the group's `GroupTree` (`appo_trl.rollout.group_tree`): the rows that really share
tokens, the same tree tree credit used, so a reader can recompute the tree advantages from `parent`, `branch_pos`,
`length` and `reward` alone (outcome rewards; `tests/trainer/test_tree_credit_trainer.py` does).

A step's file holds that step's rounds of the current run only: the first round a process dumps for a step
replaces the file (a step re-run after a resume, or after a kill, does not keep the killed run's records);
later rounds of the same step (`steps_per_generation` > gradient accumulation) are appended to it.

`appo rollouts OUTPUT_DIR` (appo_trl/cli/rollouts.py) renders them. Texts are cut to `MAX_CHARS`; the dump is
for reading, not for replay (token ids are not stored).

What this does not do: gather groups from other ranks (each rank's first groups are the same kind of sample).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MAX_CHARS = 4000
CONTEXT_TOKENS = 24


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):  # chat messages: the last user turn
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1] if users else prompt[-1].get("content", ""))
    return str(prompt)


def _cut(text: str, n: int = MAX_CHARS) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def group_records(batch, inputs: list[dict], rewards, advantages, completion_mask, tokenizer, *, step: int,
                  strategy: str, max_groups: int) -> list[dict]:  # fmt: skip
    """One record per group (the first `max_groups`) of a `Round` whose rows line up with `inputs`."""
    from appo_trl.algorithms.tree_credit import runs
    from appo_trl.rollout.group_tree import GroupTree

    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    credits = batch.tree_credit
    records, row = [], 0
    for g, group in enumerate(batch.groups):
        if g >= max_groups:
            break
        tree = GroupTree.of(group)
        rows = []
        for i, t in enumerate(group):
            r, n = row + i, len(t.completion_ids)
            adv = advantages[r]
            if getattr(adv, "dim", lambda: 0)() > 0:  # (T,) token advantages: mean over the row's tokens
                token_adv = [float(x) for x in adv[:n].tolist()] + [0.0] * max(0, n - adv.numel())
                m = completion_mask[r].float()
                adv = (adv.float() * m).sum() / m.sum().clamp(min=1)
            else:
                token_adv = [float(adv)] * n
            node_runs = None
            if credits is not None:
                c = credits[g]
                pairs = list(zip(c.node_values[i, :n].tolist(), c.rows_through[i, :n].tolist()))
                node_runs = [[s, e, v, k] for s, e, (v, k) in runs(pairs)]
            parent = tree.parents[i] if tree.parents[i] >= 0 else None
            bp = tree.branch_pos[i] if parent is not None else None
            rows.append({
                "index": i, "uid": t.uid, "parent": parent, "origin": str(t.origin), "role": str(t.role),
                "branch_pos": bp, "advantage_runs": runs(token_adv), "node_runs": node_runs,
                "fork_context": decode(list(t.completion_ids[max(0, bp - CONTEXT_TOKENS) : bp])) if bp else "",
                "reward": float(rewards[r]), "advantage": float(adv), "kept": bool(batch.keep[r]),
                "num_calls": int(t.num_calls),
                "tool_calls": [{"tag": c.tag, "query": _cut(c.query, 300), "ok": bool(c.ok), "result": _cut(c.result, 300)}
                               for c in t.tool_calls],
                "finish_reason": t.finish_reason, "length": n,
                "completion": _cut(decode(list(t.completion_ids))),
                "continuation": _cut(decode(list(t.completion_ids[bp:]))) if bp else None,
            })  # fmt: skip
        first = inputs[row] if row < len(inputs) else {}
        answer = first.get("answer")
        records.append({
            "step": step, "group": g, "strategy": strategy, "prompt": _cut(_prompt_text(first.get("prompt", "")), 2000),
            "answer": answer if isinstance(answer, (str, int, float, list, type(None))) else str(answer),
            "rows": rows,
        })  # fmt: skip
        row += len(group)
    return records


def dump_round(trainer, inputs, batch, rewards, out: dict) -> Path | None:
    """Write this round's first `args.dump_rollouts` groups to `output_dir/rollouts/step_<N>.jsonl` (main process):
    the step's first round in this process replaces the file, later rounds of the step are appended."""
    args = trainer.args
    if not args.dump_rollouts or not trainer.accelerator.is_main_process:
        return None
    step = trainer.state.global_step + 1
    records = group_records(
        batch, inputs, rewards.detach().cpu(), out["advantages"].detach().cpu(), out["completion_mask"].detach().cpu(),
        trainer._tokenizer, step=step, strategy=args.rollout_strategy, max_groups=args.dump_rollouts,
    )  # fmt: skip
    path = Path(args.output_dir) / "rollouts" / f"step_{step:06d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    written = trainer.__dict__.setdefault("_rollout_dump_steps", set())  # steps this process has written
    mode = "a" if step in written else "w"
    written.add(step)
    with open(path, mode, encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def read_dumps(output_dir: str | Path, step: int | None = None) -> tuple[int, list[dict]]:
    """(step, group records) of `step`, or of the newest dumped step when `step` is None."""
    folder = Path(output_dir) / "rollouts"
    files = sorted(folder.glob("step_*.jsonl"))
    if not files:
        raise FileNotFoundError(
            f"No rollouts in {folder}: train with `--dump_rollouts 2` (groups per step) to write some."
        )
    by_step = {int(p.stem.split("_")[1]): p for p in files}
    if step is None:
        step = max(by_step)
    if step not in by_step:
        raise FileNotFoundError(f"No rollouts for step {step} in {folder}; dumped steps: {sorted(by_step)}")
    lines = by_step[step].read_text(encoding="utf-8").splitlines()
    return step, [json.loads(line) for line in lines if line.strip()]
