"""`appo tool python [--code CODE | < file]` and `appo tool search QUERY [--backend ...]`: one call, JSON out.

The result is printed as one JSON object (`{"ok", "text", "latency_s", "truncated", "error", "meta"}`). The exit
code is 0 whenever the tool ran, even if it reported an error (the error is data); 2 means bad usage.
`--set key=value` passes any tool parameter (`--set timeout_s=5`, `--set cache_path=cache.json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import yaml


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="appo tool", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="tool", required=True)
    py = sub.add_parser("python", help="run code in the python sandbox (from --code or stdin)")
    py.add_argument("--code", help="the code (default: read stdin)")
    py.add_argument("--timeout", type=float, help="wall-clock limit, seconds")
    se = sub.add_parser("search", help="run one search")
    se.add_argument("query")
    se.add_argument("--backend", help="local | web | cache")
    se.add_argument("--url", help="retriever endpoint for --backend local")
    se.add_argument("--cache-path", help="SQLite cache, or ARPO JSON cache for --backend cache")
    for sp in (py, se):
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any tool parameter")
    return p


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    params: dict = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"appo tool: --set expects KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        params[key] = yaml.safe_load(value)
    if args.tool == "python":
        if args.timeout is not None:
            params["timeout_s"] = args.timeout
        text = args.code if args.code is not None else sys.stdin.read()
    else:
        for key in ("backend", "url", "cache_path"):
            if getattr(args, key) is not None:
                params[key] = getattr(args, key)
        text = args.query
    from appo_trl.tools.registry import build_tools

    try:
        tool = build_tools([args.tool], {args.tool: params})[args.tool]
    except ValueError as exc:
        print(f"appo tool: {exc}", file=sys.stderr)
        return 2

    async def run():
        try:
            return await tool.call(text)
        finally:
            await tool.aclose()

    result = asyncio.run(run())
    print(json.dumps(result.to_dict(), ensure_ascii=False))
    return 0
