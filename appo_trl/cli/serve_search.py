"""`appo serve-search --corpus FILE.jsonl [--host 127.0.0.1 --port 8765]`: the local BM25 retriever server.

Speaks the Search-R1 protocol (`POST /retrieve`) and identifies itself on `GET /health`; see
`appo_trl.tools.search_server`. The search tool's default URL is this server's default,
`http://127.0.0.1:8765/retrieve` (port 8000 is left to `vllm serve`).
"""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appo serve-search", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="JSONL corpus: one {'contents'} or {'title','text'} per line")
    p.add_argument("--index-dir", help="where the BM25 index is saved (default: <corpus>.bm25s)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="default 8765 (the search tool's default URL)")
    p.add_argument("--build-only", action="store_true", help="build (or check) the index and exit")
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("bm25s").setLevel(logging.WARNING)
    from appo_trl.tools.search_server import BM25Index, create_app

    try:
        index = BM25Index(args.corpus, args.index_dir)
    except (OSError, ValueError) as exc:
        print(f"appo serve-search: {exc}", file=sys.stderr)
        return 2
    how = "reused" if index.reused else "built"
    print(f"appo serve-search: {len(index)} documents, index {how} at {index.index_dir}", flush=True)
    if args.build_only:
        return 0
    import uvicorn

    uvicorn.run(create_app(index), host=args.host, port=args.port, log_level="warning")
    return 0
