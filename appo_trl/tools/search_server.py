"""A local BM25 retriever server speaking the Search-R1 `/retrieve` protocol (`appo serve-search`).

`POST /retrieve {"queries": [str, ...], "topk": int, "return_scores": bool}` returns
`{"result": [[{"document": {...}, "score": float}, ...], ...]}` (one list per query, best first; without
`return_scores` each item is the document itself, as Search-R1's server does). `GET /health` identifies the
server: `{"status": "ok", "service": "appo-trl-search", "version": 1, "documents": N, "corpus_fingerprint":
sha256 of the corpus file}`; the search tool checks it before a run (so it never searches a vLLM server that
happens to listen on the same port) and keys its cache by the fingerprint (so results of one corpus are never
served for another). Queries of one request are scored together (bm25s is vectorised).

The corpus is a JSONL file, one document per line, with `contents` (Search-R1: `"Title"\\ntext`) or
`title`/`text` fields (`id` optional). The BM25 index is built on first start and saved next to the corpus
(`<corpus>.bm25s/`, or `--index-dir`) together with a fingerprint of the corpus file (size, mtime); later
starts load it instead of re-indexing, and a changed corpus is re-indexed.

It binds 127.0.0.1 by default and has no authentication: do not expose it beyond the machine. It does not do
dense retrieval, stemming or snippet extraction; documents are returned whole.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from typing import Any

from pydantic import BaseModel, Field

logger = logging.getLogger(__name__)

FINGERPRINT = "appo_fingerprint.json"
SERVICE_NAME = "appo-trl-search"
DEFAULT_PORT = 8765  # not 8000, where `vllm serve` listens by default


def corpus_sha256(path: str) -> str:
    """The corpus identity reported on `/health`: sha256 of the file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fingerprint(path: str) -> dict[str, Any]:
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _index_text(doc: dict[str, Any]) -> str:
    if doc.get("contents"):
        return str(doc["contents"])
    return f"{doc.get('title') or ''} {doc.get('text') or ''}".strip()


def load_corpus(path: str) -> list[dict[str, Any]]:
    """Read a JSONL corpus; raises ValueError naming the first bad line."""
    docs = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc})") from None
            if not isinstance(doc, dict) or not _index_text(doc):
                raise ValueError(f"{path}:{lineno}: expected an object with 'contents' or 'title'/'text'")
            docs.append(doc)
    if not docs:
        raise ValueError(f"{path}: the corpus is empty")
    return docs


class BM25Index:
    """A bm25s index over a JSONL corpus, built once and reused (see the module docstring)."""

    def __init__(self, corpus_path: str, index_dir: str | None = None):
        import bm25s

        self.corpus_path = corpus_path
        self.index_dir = index_dir or corpus_path + ".bm25s"
        self.docs = load_corpus(corpus_path)
        self.fingerprint = corpus_sha256(corpus_path)
        fingerprint = _fingerprint(corpus_path)
        stamp = os.path.join(self.index_dir, FINGERPRINT)
        self.reused = False
        if os.path.exists(stamp):
            with open(stamp) as fh:
                self.reused = json.load(fh) == fingerprint
        if self.reused:
            self.retriever = bm25s.BM25.load(self.index_dir, show_progress=False)
        else:
            tokens = bm25s.tokenize([_index_text(d) for d in self.docs], stopwords="en", show_progress=False)
            self.retriever = bm25s.BM25()
            self.retriever.index(tokens, show_progress=False)
            tmp = self.index_dir + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            self.retriever.save(tmp, show_progress=False)
            with open(os.path.join(tmp, FINGERPRINT), "w") as fh:
                json.dump(fingerprint, fh)
            shutil.rmtree(self.index_dir, ignore_errors=True)
            os.replace(tmp, self.index_dir)

    def __len__(self) -> int:
        return len(self.docs)

    def retrieve(self, queries: list[str], topk: int) -> list[list[tuple[dict[str, Any], float]]]:
        import bm25s

        k = max(1, min(int(topk), len(self.docs)))
        tokens = bm25s.tokenize(queries, stopwords="en", return_ids=False, show_progress=False)
        ids, scores = self.retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        out = []
        for row_ids, row_scores in zip(ids, scores):
            out.append([(self.docs[int(i)], float(s)) for i, s in zip(row_ids, row_scores) if s > 0])
        return out


class RetrieveRequest(BaseModel):
    """Body of `POST /retrieve` (Search-R1 protocol)."""

    queries: list[str] = Field(..., description="queries, scored as one batch")
    topk: int = Field(3, ge=1, description="documents per query")
    return_scores: bool = False


def create_app(index: BM25Index, max_batch: int = 1024, max_topk: int = 100):
    """The FastAPI application serving `index`."""
    from fastapi import FastAPI, HTTPException

    app = FastAPI(title="appo-trl BM25 retriever", version="1")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "service": SERVICE_NAME,
            "version": 1,
            "documents": len(index),
            "corpus_fingerprint": index.fingerprint,
        }

    @app.post("/retrieve")
    def retrieve(req: RetrieveRequest) -> dict[str, Any]:
        if len(req.queries) > max_batch:
            raise HTTPException(413, f"at most {max_batch} queries per request")
        hits = index.retrieve(req.queries, min(req.topk, max_topk)) if req.queries else []
        if req.return_scores:
            return {"result": [[{"document": d, "score": s} for d, s in row] for row in hits]}
        return {"result": [[d for d, _ in row] for row in hits]}

    return app
