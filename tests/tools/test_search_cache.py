"""The persistent search cache: normalised keys, ARPO seed, corruption, concurrent writers, kill -9 mid-write."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys

import pytest

from appo_trl.tools.search_cache import SearchCache, normalize_query

pytestmark = pytest.mark.timeout(120)


def test_normalized_keys(tmp_path):
    assert normalize_query('  "Who WROTE\tHamlet?" ') == "who wrote hamlet"
    cache = SearchCache(str(tmp_path / "c.sqlite"))
    cache.put("Capital of France", "Page 1: Paris")
    assert cache.get('capital   of "france"?') == "Page 1: Paris"
    assert cache.get("capital of germany") is None
    other = SearchCache(str(tmp_path / "c.sqlite"), namespace="web")
    assert other.get("Capital of France") is None and len(other) == 0 and len(cache) == 1


def test_seed_from_arpo_json_keeps_existing_entries(tmp_path, arpo_data_dir):
    path = os.path.join(arpo_data_dir, "search_cache.json")
    with open(path) as fh:
        data = json.load(fh)
    first = next(iter(data))
    cache = SearchCache(str(tmp_path / "c.sqlite"))
    cache.put(first, "mine")
    cache.seed_from_json(path)
    assert len(cache) == len({normalize_query(k) for k in data})
    assert cache.get(first) == "mine"
    some = list(data)[10]
    assert cache.get(some) == data[some]


def test_corrupted_file_is_moved_aside(tmp_path, caplog):
    path = tmp_path / "c.sqlite"
    first = SearchCache(str(path))
    first.put("q", "v")
    first.close()
    path.write_bytes(b"this is not a database" * 100)
    cache = SearchCache(str(path))
    assert cache.get("q") is None  # fresh, usable cache
    cache.put("q2", "v2")
    assert cache.get("q2") == "v2"
    assert any(p.name.startswith("c.sqlite.corrupt-") for p in tmp_path.iterdir())


WRITER = """
import sys
from appo_trl.tools.search_cache import SearchCache
cache = SearchCache(sys.argv[1], busy_timeout_s=60)
for i in range(int(sys.argv[3])):
    cache.put(f"{sys.argv[2]} query {i}", f"Page 1: result {i}")
    print(i, flush=True)
"""


def test_two_processes_writing_concurrently_lose_nothing(tmp_path):
    path = str(tmp_path / "c.sqlite")
    SearchCache(path).close()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, path, name, "150"], stdout=subprocess.DEVNULL)
             for name in ("alpha", "beta")]  # fmt: skip
    assert [p.wait(timeout=100) for p in procs] == [0, 0]
    cache = SearchCache(path)
    assert len(cache) == 300
    assert cache.get("alpha query 149") == "Page 1: result 149" and cache.get("beta query 0") == "Page 1: result 0"


def test_kill_9_mid_write_keeps_committed_entries(tmp_path):
    path = str(tmp_path / "c.sqlite")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, path, "k", "100000"], stdout=subprocess.PIPE, text=True)
    committed = -1
    for line in proc.stdout:
        committed = int(line)
        if committed >= 200:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    cache = SearchCache(path)
    assert all(cache.get(f"k query {i}") == f"Page 1: result {i}" for i in range(committed + 1))
