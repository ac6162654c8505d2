"""Sample trajectories of a training run, written as JSON lines and read back as branch trees.

With `dump_rollouts: K` the trainer writes the first K groups of every training round on the main process to
`output_dir/rollouts/step_<N>.jsonl` (N = the optimizer step the round trains), one JSON object per group:

    {"step", "group", "strategy", "prompt", "answer",
     "rows": [{"index", "uid", "parent" (row index or null), "origin" (root | fork | refill | branch),
               "branch_pos" (tokens copied from the parent), "fork_context" (text just before the fork),
               "reward", "advantage" (mean over the row's tokens), "kept" (reaches the loss),
               "num_calls", "tool_calls": [{"tag", "query", "ok", "result"}], "finish_reason", "length",
               "completion", "continuation" (a branch's text after its fork, else null)}]}

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
    """One record per group (the first `max_groups`) of a `RoundBatch` whose rows line up with `inputs`."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    records, row = [], 0
    for g, group in enumerate(batch.groups):
        if g >= max_groups:
            break
        index = {t.uid: i for i, t in enumerate(group)}
        rows = []
        for i, t in enumerate(group):
            r = row + i
            adv = advantages[r]
            if getattr(adv, "dim", lambda: 0)() > 0:  # (T,) token advantages: mean over the row's tokens
                m = completion_mask[r].float()
                adv = (adv.float() * m).sum() / m.sum().clamp(min=1)
            bp = t.branch_pos
            rows.append({
                "index": i, "uid": t.uid, "parent": index.get(t.parent), "origin": t.origin,
                "branch_pos": bp,
                "fork_context": decode(list(t.completion_ids[max(0, bp - CONTEXT_TOKENS) : bp])) if bp else "",
                "reward": float(rewards[r]), "advantage": float(adv), "kept": bool(batch.keep[r]),
                "num_calls": int(t.num_calls),
                "tool_calls": [{"tag": c.tag, "query": _cut(c.query, 300), "ok": bool(c.ok), "result": _cut(c.result, 300)}
                               for c in t.tool_calls],
                "finish_reason": t.finish_reason, "length": len(t.completion_ids),
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
