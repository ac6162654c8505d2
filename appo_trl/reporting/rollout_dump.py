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
               "completion", "continuation" (a branch's text after its fork, else null),
               "tokens": [text of each token, the first MAX_TOKENS], "mask_runs": [[start, end, 0 | 1], ...]
                   (the loss mask: 0 for tool results and template tokens), "tool_spans": [[start, end], ...]
                   (injected tool results), "branch_entropy" (a branch: the sampler's entropy at its fork, when
                   recorded), "branch_score" (APPO: the branch point's score), "role" ("chain" for an agent run's
                   other chain, which follows the group's rows and names its run row in "run"; else "row"),
               "version_runs" (per-token policy versions as runs, when the row carries them)}]}

`parent` and `branch_pos` are the group's `GroupTree` (`appo_trl.rollout.group_tree`): the rows that really share
tokens, the same tree tree credit used, so a reader can recompute the tree advantages from `parent`, `branch_pos`,
`length` and `reward` alone (outcome rewards; `tests/trainer/test_tree_credit_trainer.py` does).

An agent row's tool calls are read from its messages (the assistant's `tool_calls` and the tool turns answering
them) when the engine recorded none, and an agent's other chain's from its text (`<tool_call>` blocks). A file is written whole or not at all (a temp file renamed over it), and a
full disk is one line, `RolloutDumpError`, naming the file and the free space (`appo_trl.reporting.atomic`).

A step's file holds that step's rounds of the current run only: the first round a process dumps for a step
replaces the file (a step re-run after a resume, or after a kill, does not keep the killed run's records);
later rounds of the same step (`steps_per_generation` > gradient accumulation) are appended to it.

`appo rollouts OUTPUT_DIR` (appo_trl/cli/rollouts.py) renders them. Texts are cut to `MAX_CHARS`; the dump is
for reading, not for replay (token ids are not stored).

What this does not do: gather groups from other ranks (each rank's first groups are the same kind of sample).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from appo_trl.reporting.atomic import DiskFullError, write_whole

RolloutDumpError = DiskFullError  # a full disk while dumping: one line (the name this module's callers know)

MAX_CHARS = 4000
MAX_TOKENS = 4096  # token texts dumped per row (the viewer colours each; advantage runs cover the whole row)
CONTEXT_TOKENS = 24
PIECE_WINDOW = 4  # tokens decoded together so a character split over several byte-level tokens comes out whole


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):  # chat messages: the last user turn
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1] if users else prompt[-1].get("content", ""))
    return str(prompt)


def _cut(text: str, n: int = MAX_CHARS) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds (special tokens included), joining to the row's text: each token decoded alone, and
    near a token that is part of a character (a byte-level piece), decoded in windows of `PIECE_WINDOW` tokens so the
    character goes whole to the token that completes it."""
    if not ids:
        return []
    kw = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer: decode in Rust, one call per batch
    if backend is not None:
        many = lambda seqs, **k: backend.decode_batch(seqs, skip_special_tokens=False)  # noqa: E731
    else:
        many = getattr(tokenizer, "batch_decode", None) or (lambda seqs, **k: [tokenizer.decode(x) for x in seqs])

    def windowed(where: list[int]) -> list[str]:
        starts = [max(0, i - PIECE_WINDOW + 1) for i in where]
        upto = many([ids[s : i + 1] for i, s in zip(where, starts)], **kw)
        before = many([ids[s:i] for i, s in zip(where, starts)], **kw)
        out = []
        for a, b in zip(upto, before):
            b = b.rstrip("\ufffd")  # an unfinished character before this token
            out.append((a[len(b) :] if a.startswith(b) else a).replace("\ufffd", ""))
        return out

    pieces = many([[i] for i in ids], **kw)
    near = sorted(
        {k for j, p in enumerate(pieces) if "\ufffd" in p for k in range(j, min(len(ids), j + PIECE_WINDOW))}
    )
    for k, p in zip(near, windowed(near) if near else []):
        pieces[k] = p
    if "".join(pieces) == many([ids], **kw)[0]:
        return pieces
    return windowed(list(range(len(ids))))


def agent_tool_calls(messages: list[dict] | None) -> list[dict]:
    """An agent run's tool calls from its messages: each assistant `tool_calls` entry with the tool turn that answers
    it (`ok` is None: an agent's tool reports no failure flag to the trainer)."""
    results = {m.get("tool_call_id"): m.get("content") for m in messages or [] if m.get("role") == "tool"}
    calls = []
    for m in messages or []:
        for c in (m.get("tool_calls") or []) if m.get("role") == "assistant" else []:
            fn = c.get("function") or {}
            result = results.get(c.get("id"))
            calls.append({"tag": str(fn.get("name") or "tool"), "query": _cut(str(fn.get("arguments") or ""), 300),
                          "ok": None, "result": _cut(str(result if result is not None else ""), 300)})  # fmt: skip
    return calls


_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_RESULT = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.S)


def text_tool_calls(text: str) -> list[dict]:
    """The chat format's tool calls in a row's text (`<tool_call>` JSON, answered by `<tool_response>` blocks in
    order): an agent's other chains, which keep no messages."""
    results = _RESULT.findall(text)
    calls = []
    for k, body in enumerate(_CALL.findall(text)):
        try:
            obj = json.loads(body)
            name, args = (obj.get("name"), obj.get("arguments")) if isinstance(obj, dict) else (None, body)
        except json.JSONDecodeError:
            name, args = None, body
        query = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        result = results[k] if k < len(results) else ""
        calls.append(
            {"tag": str(name or "tool_call"), "query": _cut(query, 300), "ok": None, "result": _cut(result, 300)}
        )
    return calls


def _row_record(t, i: int, *, adv, token_adv: list[float], kept: bool, reward: float, parent, bp, decode,
                pieces, node_runs=None, score=None, entropy=None, role: str | None = None, run=None) -> dict:  # fmt: skip
    """One row of a group record (module docstring); `role` defaults to the row's own (`Role`)."""
    role = role or str(t.role)
    from appo_trl.algorithms.tree_credit import runs

    n = len(t.completion_ids)
    calls = [{"tag": c.tag, "query": _cut(c.query, 300), "ok": bool(c.ok), "result": _cut(c.result, 300)}
             for c in t.tool_calls] or agent_tool_calls(getattr(t, "messages", None))  # fmt: skip
    if not calls and role == "chain":
        calls = text_tool_calls(decode(list(t.completion_ids)))
    versions = getattr(t, "versions", None)  # per token (`Trajectory.versions`): [[start, end, version], ...]
    versions = None if versions is None else runs([int(v) for v in versions])
    return {
        "index": i, "uid": t.uid, "parent": parent, "origin": str(t.origin), "role": role, "run": run,
        "branch_pos": bp, "advantage_runs": runs(token_adv), "node_runs": node_runs,
        "fork_context": decode(list(t.completion_ids[max(0, bp - CONTEXT_TOKENS) : bp])) if bp else "",
        "reward": reward, "advantage": float(adv), "kept": kept,
        "num_calls": max(int(t.num_calls), len(calls)), "tool_calls": calls,
        "finish_reason": t.finish_reason, "length": n,
        "completion": _cut(decode(list(t.completion_ids))),
        "continuation": _cut(decode(list(t.completion_ids[bp:]))) if bp else None,
        "tokens": pieces(list(t.completion_ids[:MAX_TOKENS])),
        "mask_runs": runs([int(m) for m in t.loss_mask]),
        "tool_spans": [[c.start, c.end] for c in t.tool_calls],
        "branch_entropy": entropy, "branch_score": score,
        "version_runs": versions,
    }  # fmt: skip


def _finite(x) -> float | None:
    return float(x) if x is not None and x == x and abs(float(x)) != float("inf") else None


def group_records(batch, inputs: list[dict], rewards, advantages, completion_mask, tokenizer, *, step: int,
                  strategy: str, max_groups: int) -> list[dict]:  # fmt: skip
    """One record per group (the first `max_groups`) of a `Round` whose rows line up with `inputs`."""
    from appo_trl.algorithms.tree_credit import runs
    from appo_trl.rollout.group_tree import GroupTree

    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    pieces = lambda ids: token_pieces(tokenizer, ids)  # noqa: E731
    credits, points = batch.tree_credit, batch.points
    records, row = [], 0
    for g, group in enumerate(batch.groups):
        if g >= max_groups:
            break
        tree = GroupTree.of(group)
        scores = {}  # APPO: row index in the group -> its branch point's score (branches follow the initial rows)
        if points is not None and g < len(points) and points[g]:
            first_branch = len(group) - len(points[g])
            scores = {first_branch + k: _finite(getattr(p, "score", None)) for k, p in enumerate(points[g])}
        rows, chains = [], []
        for i, t in enumerate(group):
            r, n = row + i, len(t.completion_ids)
            adv = advantages[r]
            if getattr(adv, "dim", lambda: 0)() > 0:  # (T,) token advantages: mean over the row's tokens
                token_adv = [float(x) for x in adv[:n].tolist()] + [0.0] * max(0, n - adv.numel())
                first_adv = token_adv[0] if token_adv else 0.0
                m = completion_mask[r].float()
                adv = (adv.float() * m).sum() / m.sum().clamp(min=1)
            else:
                token_adv = [float(adv)] * n
                first_adv = float(adv)
            node_runs = None
            if credits is not None:
                c = credits[g]
                pairs = list(zip(c.node_values[i, :n].tolist(), c.rows_through[i, :n].tolist()))
                node_runs = [[s, e, v, k] for s, e, (v, k) in runs(pairs)]
            parent = tree.parents[i] if tree.parents[i] >= 0 else None
            bp = tree.branch_pos[i] if parent is not None else None
            entropy = None
            if bp is not None:  # the sampler's entropy at the fork: the parent's distribution there
                for source in (group[parent], t):
                    if source.entropies is not None and bp < len(source.entropies):
                        entropy = _finite(source.entropies[bp])
                        break
            reward, kept = float(rewards[r]), bool(batch.keep[r])
            rows.append(_row_record(t, i, adv=adv, token_adv=token_adv, kept=kept, reward=reward, parent=parent,
                                    bp=bp, decode=decode, pieces=pieces, node_runs=node_runs, score=scores.get(i),
                                    entropy=entropy))  # fmt: skip
            for other in getattr(t, "chain_rows", None) or []:  # the run's other chains: its advantage, its reward
                k = len(other.completion_ids)
                chains.append(_row_record(other, 0, adv=first_adv, token_adv=[first_adv] * k, kept=kept, reward=reward,
                                          parent=None, bp=None, decode=decode, pieces=pieces, role="chain", run=i))  # fmt: skip
        for k, c in enumerate(chains):
            c["index"] = len(rows) + k
        rows += chains
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
        trainer.processing_class_tokenizer, step=step, strategy=args.rollout_strategy, max_groups=args.dump_rollouts,
    )  # fmt: skip
    path = Path(args.output_dir) / "rollouts" / f"step_{step:06d}.jsonl"
    written = trainer.__dict__.setdefault("_rollout_dump_steps", set())  # steps this process has written
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    write_whole(
        path,
        text,
        append=step in written,
        then="free some space, or set dump_rollouts: 0, then resume with --resume_from_checkpoint true",
    )
    written.add(step)
    from appo_trl.reporting.rollout_page import log_step_page

    log_step_page(trainer, step)  # report_to: the step's page in wandb / trackio, a file and a link for tensorboard
    return path


def read_dumps(output_dir: str | Path, step: int | None = None) -> tuple[int, list[dict]]:
    """(step, group records) of `step`, or of the newest dumped step when `step` is None; `DumpError` (a
    `FileNotFoundError`) when there is none. Damaged lines are left out: `rollout_read.read_step` says which."""
    from appo_trl.reporting.rollout_read import find_dump, read_step

    dump = find_dump(output_dir)
    got = read_step(dump.path_of(step))
    return got.step, got.groups
