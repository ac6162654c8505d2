"""Persistent search cache: SQLite (WAL) keyed by normalised query, shared safely by many processes.

Why SQLite: every write is a transaction, so several trainer/eval processes can write at once (the database lock
serialises them; `busy_timeout` waits instead of failing), and a process killed with `kill -9` mid-write leaves
a valid file in which every committed entry survives (the unfinished transaction is rolled back on next open).
ARPO's cache was one JSON file rewritten from memory by a writer thread, which can lose entries written by
another process between its read and its rename.

Keys are normalised (`normalize_query`: NFKC, lower case, double quotes removed as ARPO does, whitespace
collapsed, surrounding punctuation stripped), prefixed by a namespace and a *scope* and followed by a *source*:
the search tool's scope is the parameters that shape a result (`max_results`, `result_length`), its source the
backend's identity (the search server's corpus fingerprint, or the web market), so that another corpus, another
server or other parameters never answer from this entry. ARPO's JSON cache (`{query: "Page 1: ...\\nPage 2: ..."}`) can be imported as a
seed (`seed_from_json`), or read directly in replay-only mode (`JsonReplayCache`).

What it does not do: no expiry (results are frozen on purpose, for reproducible runs), no size bound. A file that
is not a valid SQLite database is moved aside (`<path>.corrupt-<time>`) and a fresh cache is started, with a
warning: the cache is an accelerator, never a reason to stop training.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
import threading
import time
import unicodedata

logger = logging.getLogger(__name__)

_SPACES = re.compile(r"\s+")
_EDGE_PUNCT = " \t\n.,;:!?'`()[]{}<>"


def normalize_query(query: str) -> str:
    """The cache key of a query: NFKC, lower case, no double quotes, single spaces, no edge punctuation."""
    text = unicodedata.normalize("NFKC", query).replace('"', " ").lower()
    return _SPACES.sub(" ", text).strip(_EDGE_PUNCT)


class SearchCache:
    """A key -> text cache in one SQLite file (thread-safe; safe across processes).

    Args:
        path: the SQLite file (its folder is created).
        namespace: prefix of every key (e.g. the backend name), so caches of different backends can share a file.
        busy_timeout_s: how long a writer waits for another process's lock before giving up on that write.
    """

    def __init__(self, path: str, namespace: str = "search", busy_timeout_s: float = 30.0):
        self.path = os.path.abspath(os.path.expanduser(path))
        self.namespace = namespace
        self.busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        try:
            self._conn = self._open()
        except sqlite3.DatabaseError as exc:
            aside = f"{self.path}.corrupt-{int(time.time())}"
            logger.warning("search cache %s is unreadable (%s); moved to %s, starting empty", self.path, exc, aside)
            os.replace(self.path, aside)
            for suffix in ("-wal", "-shm"):
                if os.path.exists(self.path + suffix):
                    os.replace(self.path + suffix, aside + suffix)
            self._conn = self._open()

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, check_same_thread=False, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(
                "CREATE TABLE IF NOT EXISTS cache (key TEXT PRIMARY KEY, query TEXT NOT NULL, value TEXT NOT NULL,"
                " created REAL NOT NULL)"
            )
            if conn.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                raise sqlite3.DatabaseError("quick_check failed")
        except sqlite3.DatabaseError:
            conn.close()
            raise
        return conn

    def key(self, query: str, scope: str = "", source: str = "") -> str:
        """`namespace SEP [scope SEP] normalised-query [SEP source]` (SEP = ASCII unit separator, which
        `normalize_query` never leaves in a query). `scope`: what shapes a result (the search tool's parameters);
        `source`: who produced it (the backend identity), last so that a replay finds it by prefix."""
        middle = f"{scope}\x1f" if scope else ""
        tail = f"\x1f{source}" if source else ""
        return f"{self.namespace}\x1f{middle}{normalize_query(query)}{tail}"

    def get(self, query: str, scope: str = "", source: str = "") -> str | None:
        key = self.key(query, scope, source)
        with self._lock:
            row = self._conn.execute("SELECT value FROM cache WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def get_any(self, query: str, scope: str = "") -> str | None:
        """The newest entry for `query` in `scope` from any source (cache-only replay, where the backend that
        produced the entries is not running); an index range scan."""
        low = self.key(query, scope) + "\x1f"
        sql = "SELECT value FROM cache WHERE key >= ? AND key < ? ORDER BY created DESC LIMIT 1"
        with self._lock:
            row = self._conn.execute(sql, (low, low + "\U0010ffff")).fetchone()
        return None if row is None else row[0]

    def put(self, query: str, value: str, scope: str = "", source: str = "") -> None:
        """Store one entry (last writer wins); committed when this returns."""
        self.put_many([(query, value)], replace=True, scope=scope, source=source)

    def put_many(self, items, replace: bool = True, scope: str = "", source: str = "") -> int:
        """Store many `(query, value)` pairs in one transaction; returns the number of rows written."""
        verb = "INSERT OR REPLACE" if replace else "INSERT OR IGNORE"
        now = time.time()
        rows = [(self.key(q, scope, source), q, v, now) for q, v in items]
        with self._lock:
            cur = self._conn.executemany(f"{verb} INTO cache (key, query, value, created) VALUES (?, ?, ?, ?)", rows)
        return cur.rowcount

    def seed_from_json(self, path: str, scope: str = "", source: str = "") -> int:
        """Import ARPO's `{query: formatted_result}` JSON cache without overwriting entries already present."""
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object {{query: result}}, got {type(data).__name__}")
        items = ((str(k), str(v)) for k, v in data.items() if isinstance(v, str))
        return self.put_many(items, replace=False, scope=scope, source=source)

    def __len__(self) -> int:
        with self._lock:
            sql = "SELECT COUNT(*) FROM cache WHERE key >= ? AND key < ?"
            return self._conn.execute(sql, (self.namespace + "\x1f", self.namespace + "\x20")).fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class JsonReplayCache:
    """Read-only view of ARPO's JSON search cache (`{query: "Page 1: ...\\nPage 2: ..."}`), normalised keys."""

    def __init__(self, path: str):
        with open(os.path.expanduser(path), encoding="utf-8") as fh:
            data = json.load(fh)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object {{query: result}}, got {type(data).__name__}")
        self.path = path
        self._data = {normalize_query(str(k)): v for k, v in data.items() if isinstance(v, str)}

    def get(self, query: str) -> str | None:
        return self._data.get(normalize_query(query))

    def __len__(self) -> int:
        return len(self._data)

    def close(self) -> None:
        pass
