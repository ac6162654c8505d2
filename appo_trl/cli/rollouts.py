"""`appo rollouts OUTPUT_DIR [--step N] [--groups K] [--chars C] [--html FILE | --serve]`: sample trajectories as
branch trees, in the terminal or in the browser.

Reads what a run wrote with `dump_rollouts: K` (`OUTPUT_DIR/rollouts/step_<N>.jsonl`, see
`appo_trl.reporting.rollout_dump`) and prints, for each group, the prompt and a tree of its rows: every root rollout
with the rows branched from it underneath, each with where it forked (token position and the text just before
the fork), its reward and advantage, with tree credit the values of the tree's nodes along its own tokens
(`V [start, end) value ×rows`, a branch's from its fork on) and the advantage runs, its tool calls (tag, ok/failed, query), how it ended, and whether it
reached the loss (APPO drops branch rows). `--full` prints the whole completions. `--html FILE` writes every dumped
step as one self-contained page (`appo_trl.reporting.rollout_page`; docs/viewer.md), and `--serve` serves it on
127.0.0.1 while the run writes more. A damaged dump (a line cut by a kill, bytes that are not UTF-8, hand-edited
records) shows what it can and one line for each thing it could not (`appo_trl.reporting.rollout_read`).

What this does not do: re-run or score anything; it shows what the trainer saw.
"""

from __future__ import annotations

import argparse
import os
import sys


def _short(text: str, chars: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= chars else text[: chars - 1] + "…"


def _label(row: dict, chars: int):
    from rich.text import Text

    label = Text()
    kind = row["origin"] if row["parent"] is not None else "root"
    if row.get("role") == "chain" or row.get("origin") == "chain":
        kind = f"chain of #{row.get('run')}"
    label.append(f"#{row['index']} {kind}", style="bold cyan" if kind == "root" else "bold magenta")
    if row["parent"] is not None and row.get("branch_pos") is not None:
        label.append(f" @ token {row['branch_pos']}", style="magenta")
        if row.get("fork_context"):
            label.append(f' after "…{_short(row["fork_context"], 40)}"', style="dim")
    reward, adv = row["reward"], row["advantage"]
    if reward is None:
        label.append("  reward —", style="yellow")
    else:
        label.append(f"  reward {reward:+.3f}", style="green" if reward > 0 else "red" if reward < 0 else "yellow")
    label.append("  adv —" if adv is None else f"  adv {adv:+.3f}")
    calls = row.get("tool_calls") or []
    if calls:
        label.append("  tools ")
        for c in calls:
            mark = "" if c.get("ok") is None else " ✓" if c["ok"] else " ✗"  # None: an agent's tool, not judged
            label.append(f"[{c.get('tag')}{mark}]", style="red" if c.get("ok") is False else "green")
    elif row.get("num_calls"):  # counted by the engine, with no record of each call
        label.append(f"  tools {row['num_calls']}")
    else:
        label.append("  no tool calls", style="dim")
    label.append(f"  {row['finish_reason']}, {row['length']} tok", style="dim")
    label.append(_versions(row), style="yellow")
    if not row.get("kept", True):
        label.append("  (not in loss)", style="dim italic")
    label.append(_credit(row), style="cyan")
    if chars:
        if row.get("continuation") is not None:  # a branch: only what it wrote after the fork
            label.append("\n…" + _short(row["continuation"], chars), style="white")
        else:
            label.append("\n" + _short(row["completion"], chars), style="white")
        for c in calls:
            label.append(f"\n  <{c.get('tag')}> {_short(c.get('query', ''), 80)}  → {_short(c.get('result', ''), 60)}",
                         style="dim")  # fmt: skip
    return label


def _versions(row: dict) -> str:
    """The row's policy versions, and where it crossed a weight update (streaming: `version_runs`)."""
    runs = row.get("version_runs") or []
    if not runs:
        return ""
    if len(runs) == 1:
        return f"  v{runs[0][2]}"
    return "  v" + " → ".join(f"{v} [{s},{e})" for s, e, v in runs) + f" (crossed {len(runs) - 1} update(s))"


def _credit(row: dict) -> str:
    """With tree credit: the node values and advantages along the row's own tokens (a branch's from its fork)."""
    nodes, start = row.get("node_runs"), row.get("branch_pos") or 0
    if not nodes:
        return ""
    own = [n for n in nodes if n[1] > start]
    values = " ".join(f"[{max(s, start)},{e}) {v:+.2f}×{k}" for s, e, v, k in own)
    advs = " ".join(f"{a:+.2f}" for s, e, a in row.get("advantage_runs") or [] if e > start)
    return f"\n  V {values}  ·  A {advs}"


def group_tree(record: dict, chars: int = 160):
    """A rich `Tree` for one dumped group: roots at the top, each branch under the row it forked from."""
    from rich.tree import Tree

    answer = record.get("answer")
    head = f"[bold]group {record['group']}[/bold] · {record['strategy']} · {_short(record['prompt'], 120)}"
    if answer not in (None, ""):
        head += f"  [dim](answer: {_short(answer if isinstance(answer, str) else str(answer), 40)})[/dim]"
    tree = Tree(head)
    rows = record["rows"]
    nodes = {}
    pending = list(rows)
    while pending:  # parents before children, whatever the row order
        progressed = False
        for row in list(pending):
            parent = row["parent"]
            if parent is None or parent in nodes or parent not in {r["index"] for r in rows}:
                nodes[row["index"]] = (nodes[parent] if parent in nodes else tree).add(_label(row, chars))
                pending.remove(row)
                progressed = True
        if not progressed:  # a cycle cannot happen, but never loop forever
            for row in pending:
                nodes[row["index"]] = tree.add(_label(row, chars))
            break
    return tree


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="appo rollouts", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("output_dir", help="output_dir of an `appo train` run with dump_rollouts > 0")
    p.add_argument("--step", type=int, default=None, help="training step to show (default: the newest dumped)")
    p.add_argument("--groups", type=int, default=2, help="groups to show (default: %(default)s)")
    p.add_argument("--chars", type=int, default=160, help="completion characters per row, 0 hides them")
    p.add_argument("--full", action="store_true", help="whole completions")
    view = p.add_mutually_exclusive_group()
    view.add_argument("--html", metavar="FILE", help="write every dumped step (or --step N) as one HTML page")
    view.add_argument("--serve", action="store_true", help="serve the page on 127.0.0.1; new steps appear as dumped")
    p.add_argument("--port", type=int, default=0, help="--serve's port (default: a free one)")
    a = p.parse_args(argv)
    from appo_trl.reporting.rollout_read import DumpError, find_dump, read_step

    try:
        if a.serve:
            return _serve(a.output_dir, a.port)
        if a.html:
            return _html(a.output_dir, a.html, a.step)
        dump = find_dump(a.output_dir)
        got = read_step(dump.path_of(a.step))
    except DumpError as exc:
        print(f"appo rollouts: {exc}", file=sys.stderr)
        return 2
    for line in dump.notes + got.problems:
        print(f"appo rollouts: {line}", file=sys.stderr)
    if not got.groups:
        if not got.problems:
            print(f"appo rollouts: {got.path.name} has no group", file=sys.stderr)
        return 2
    from rich.console import Console

    console = Console()
    console.print(f"[bold]{a.output_dir}[/bold] · step {got.step} · {len(got.groups)} group(s) dumped")
    for record in got.groups[: a.groups]:
        console.print(group_tree(record, chars=10**9 if a.full else a.chars))
    return 0


def _html(output_dir: str, file: str, step: int | None) -> int:
    from appo_trl.reporting.rollout_page import write_page
    from appo_trl.reporting.rollout_read import DumpError

    try:
        path, size = write_page(output_dir, file, None if step is None else [step])
    except DumpError:
        raise  # the caller's one line
    except OSError as exc:
        print(f"appo rollouts: cannot write {file}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"appo rollouts: wrote {path} ({size / 2**20:.1f} MiB); open it in a browser")
    return 0


def _serve(output_dir: str, port: int) -> int:
    from appo_trl.reporting.rollout_page import make_server
    from appo_trl.reporting.rollout_read import DumpError

    if not os.path.isdir(output_dir):
        raise DumpError(f"{output_dir} does not exist: give the output_dir of an `appo train` run")
    try:
        server = make_server(output_dir, port)
    except OSError as exc:
        print(f"appo rollouts: cannot listen on 127.0.0.1:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    host, bound = server.server_address[:2]
    print(f"appo rollouts: serving {output_dir} at http://{host}:{bound}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        print("appo rollouts: stopped", file=sys.stderr)
    finally:
        server.server_close()
    return 0
