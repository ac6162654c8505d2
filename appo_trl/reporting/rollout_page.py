"""The rollout viewer: a dump as one self-contained HTML page, or served live while a run writes it.

`write_page(output_dir, file)` (`appo rollouts OUTPUT_DIR --html FILE`) writes one HTML file with the page's script
and style inline (`viewer/viewer.js`, `viewer/viewer.css`, read as package data) and the dump embedded as JSON: a
small index (one summary per step: groups, rows, reward mean and spread, branch rows, tool calls per row) that the
page parses at once, and one `<script type="application/json">` block per step that it parses only when that step
is opened. It has no network access and opens from disk. `serve(output_dir)` (`--serve`) serves the same page on
127.0.0.1 (a free port) with two JSON routes, `/index.json` and `/step/<N>.json`, read from the dump on each request
(a step file is parsed again only when its size or time changed); the page polls the index, so steps dumped after
the start appear without a restart. `log_step_page(trainer, step)` logs one step's page to the run's trackers
(wandb's and trackio's `Html`; tensorboard shows text, so it gets the page as a file beside the dump and a link).

What the page shows is described in docs/viewer.md. What this does not do: authenticate (it listens on 127.0.0.1
only; reach it from another machine through an SSH tunnel), or rewrite the dump.
"""

from __future__ import annotations

import html
import http.server
import importlib.resources
import json
import math
import os
import re
import statistics
import threading
from pathlib import Path
from typing import Any

from appo_trl.reporting.atomic import write_whole
from appo_trl.reporting.rollout_read import Dump, DumpError, DumpStep, find_dump, read_step

POLL_SECONDS = 3


def _clean(value: Any) -> Any:
    """`value` with every float that is not finite as None (the browser's JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def summary(got: DumpStep) -> dict:
    """One step at a glance (the across-steps plots): its dumped groups' reward, branch rows and tool calls."""
    rows = [r for g in got.groups for r in g["rows"] if r["role"] != "chain"]
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    return {
        "step": got.step,
        "groups": len(got.groups),
        "rows": len(rows),
        "reward_mean": statistics.fmean(rewards) if rewards else None,
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else (0.0 if rewards else None),
        "branches": sum(r["parent"] is not None for r in rows),
        "tool_calls": statistics.fmean(r["num_calls"] for r in rows) if rows else None,
        "problems": len(got.problems),
    }


def step_payload(got: DumpStep) -> dict:
    """What the page needs of one step: its groups, a row's whole text in its tokens when it has them, and a branch's
    tokens after its fork only when it shares the ones before with its parent (`tokens_shared`; the page copies)."""
    groups = []
    for g in got.groups:
        by_index = {r["index"]: r for r in g["rows"]}
        rows = []
        for r in g["rows"]:
            r = dict(r)
            if r["tokens"] is not None and len(r["tokens"]) >= r["length"]:
                r["completion"] = ""  # the page joins the tokens
            r.pop("continuation", None)
            parent, bp = by_index.get(r["parent"]), r["branch_pos"] or 0
            r["tokens_shared"] = 0
            if parent is not None and r["tokens"] and parent["tokens"] and 0 < bp <= len(r["tokens"]):
                if parent["tokens"][:bp] == r["tokens"][:bp]:
                    r["tokens"], r["tokens_shared"] = r["tokens"][bp:], bp
            rows.append(r)
        groups.append({**g, "rows": rows})
    return {"step": got.step, "file": got.path.name, "groups": groups, "problems": got.problems}


def _asset(name: str) -> str:
    return importlib.resources.files("appo_trl.reporting").joinpath("viewer", name).read_text(encoding="utf-8")


def to_json(data: Any) -> str:
    """Browser JSON: a float that is not finite (a hand-edited field the reader does not check) becomes null."""
    try:
        return json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return json.dumps(_clean(data), ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _json_script(element_id: str, data: Any) -> str:
    text = to_json(data)
    text = text.replace("<", "\\u003c")  # (only inside strings) nothing in it can end or open an element
    return f'<script type="application/json" id="{element_id}">{text}</script>'


def render(title: str, index: dict, steps: list[dict] | None, *, live: bool = False) -> str:
    """The page: `steps` embedded (one block per step), or, `live`, fetched from the server's JSON routes."""
    blocks = [_json_script("appo-index", index)]
    blocks += [_json_script(f"appo-step-{s['step']}", s) for s in steps or []]
    page = _asset("page.html")
    fill = {
        "TITLE": html.escape(title),
        "STYLE": _asset("viewer.css"),
        "DATA": "\n".join(blocks),
        "SCRIPT": _asset("viewer.js").replace("</script", "<\\/script"),
        "MODE": json.dumps({"live": live, "poll_s": POLL_SECONDS}),
    }
    return re.sub(r"/\*@(\w+)@\*/", lambda m: fill[m.group(1)], page)


def _index(dump: Dump, read: list[DumpStep]) -> dict:
    return {
        "dir": str(dump.folder.parent),
        "steps": [summary(s) for s in read],
        "notes": dump.notes + [p for s in read if not s.groups for p in (s.problems or [f"{s.path.name}: no groups"])],
    }


def build(output_dir: str | Path, steps: list[int] | None = None) -> str:
    """The whole page of a dump (of `steps` only, when given); `DumpError` when there is nothing to show."""
    dump = find_dump(output_dir)
    paths = [dump.path_of(s) for s in steps] if steps else [dump.steps[s] for s in sorted(dump.steps)]
    read = [read_step(p) for p in paths]
    title = f"rollouts · {Path(output_dir).name}"
    return render(title, _index(dump, read), [step_payload(s) for s in read])


def write_page(output_dir: str | Path, file: str | Path, steps: list[int] | None = None) -> tuple[Path, int]:
    """Write the page of `output_dir`'s dump to `file` (through a temp file renamed over it); (file, bytes)."""
    text = build(output_dir, steps)
    path = Path(file)
    write_whole(path, text, then="free some space, or write the page elsewhere")
    return path, len(text.encode("utf-8"))


class _Cache:
    """Step files read once per (size, mtime): the server re-reads only what a running trainer rewrote."""

    def __init__(self, output_dir: str | Path):
        self.output_dir, self.lock, self.read = output_dir, threading.Lock(), {}

    def step(self, path: Path) -> DumpStep:
        st = path.stat()
        key = (st.st_size, st.st_mtime_ns)
        with self.lock:
            hit = self.read.get(path)
            if hit is None or hit[0] != key:
                hit = self.read[path] = (key, read_step(path))
            return hit[1]

    def index(self) -> dict:
        try:
            dump = find_dump(self.output_dir)
        except DumpError as exc:
            return {"dir": str(self.output_dir), "steps": [], "notes": [str(exc)]}
        read = []
        for s in sorted(dump.steps):
            try:
                read.append(self.step(dump.steps[s]))
            except OSError:  # removed between the listing and the read
                continue
        return _index(dump, read)


def make_server(output_dir: str | Path, port: int = 0) -> http.server.ThreadingHTTPServer:
    """The live viewer's HTTP server on 127.0.0.1 (`port` 0: a free one); the caller runs `serve_forever`."""
    cache = _Cache(output_dir)
    page = render(f"rollouts · {Path(output_dir).name} (live)", {"dir": str(output_dir), "steps": [], "notes": []},
                  None, live=True).encode("utf-8")  # fmt: skip

    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, code: int, body: bytes, kind: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def _json(self, data: Any, code: int = 200) -> None:
            self._send(code, to_json(data).encode("utf-8"), "application/json")

        def do_GET(self):  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                return self._send(200, page, "text/html; charset=utf-8")
            if path == "/favicon.ico":  # the browser asks; there is none
                return self._send(204, b"", "image/x-icon")
            if path == "/index.json":
                return self._json(cache.index())
            m = re.fullmatch(r"/step/(\d+)\.json", path)
            if m:
                try:
                    got = cache.step(find_dump(output_dir).path_of(int(m.group(1))))
                except (DumpError, OSError) as exc:
                    return self._json({"error": str(exc)}, 404)
                return self._json(step_payload(got))
            return self._json({"error": f"no such page: {path}"}, 404)

        def log_message(self, format, *args):  # one line per step on the console, not one per request
            pass

    return http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)


def log_step_page(trainer, step: int) -> None:
    """Log `step`'s dumped groups as the viewer page to the run's trackers (`report_to`), as the module doc says."""
    report = getattr(trainer.args, "report_to", None) or []
    report = [report] if isinstance(report, str) else list(report)
    if not {"wandb", "trackio", "tensorboard", "all"} & set(report):
        return
    out = Path(trainer.args.output_dir)
    text = build(out, [step])
    if "wandb" in report or "all" in report:
        import sys

        wandb = sys.modules.get("wandb")  # only when transformers' callback started a run
        if wandb is not None and getattr(wandb, "run", None) is not None:
            wandb.log({"rollouts/page": wandb.Html(text, inject=False)}, commit=False)
    if "trackio" in report or "all" in report:
        import sys

        trackio = sys.modules.get("trackio")
        if trackio is not None and trackio.context_vars.current_run.get() is not None:
            trackio.log({"rollouts/page": trackio.Html(text)}, step=step)
    writers = [getattr(c, "tb_writer", None) for c in trainer.callback_handler.callbacks]
    writers = [w for w in writers if w is not None]
    if writers:  # tensorboard renders markdown, not HTML: the page as a file, and where it is
        page = out / "rollouts" / f"step_{step:06d}.html"
        write_whole(page, text)
        for w in writers:
            w.add_text("rollouts/page", f"Step {step}'s rollout viewer page: `{os.path.abspath(page)}` (open it in "
                       f"a browser)", global_step=step)  # fmt: skip
