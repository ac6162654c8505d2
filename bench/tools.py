"""Tools benchmark: the python sandbox vs ARPO's bare `subprocess.run([python, "-c", code])`, and search.

    python bench/tools.py [--quick] [--json]

Sandbox part: the same snippets (`print(1+1)`, a numpy import, a ~50 ms compute loop) at concurrency 1, 8 and 32,
through `PythonTool` (zygote + fresh forked child per call, rlimits, namespaces) and through ARPO's baseline (a cold
interpreter per call, run from a thread pool as ARPO's `ThreadPoolExecutor` does). Reports calls/s, p50/p99 latency
and the sandbox/bare ratios. Search part: BM25 index build time and queries/s of the local `/retrieve` server on a
synthetic corpus (100k documents; 10k with --quick), batched and one query per request, and cache-hit latency of
the search tool's SQLite cache. Layers part: `print(1+1)` p50 with the isolation layers added one at a time
(unisolated fork server, bubblewrap box, then per call: pid namespace, mount namespace + tmpfs + /proc, ipc
namespace, user namespace + capabilities dropped, seccomp, cgroups), measured round-robin so that load drifts
hit every variant alike. Preload part (with the layers): `print(1+1)` with numpy and sympy imported by the
zygote that forks every call, against the default (a template process holds them). With --json the last line is
one JSON object with every figure, including `sandbox_p50_ms`, `sandbox_calls_per_s`, `speedup_vs_bare`,
`layers`, `preload`, `search_qps` and `cache_hit_ms`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

SNIPPETS = {
    "print": "print(1+1)",
    "numpy": "import numpy as np\nprint(np.arange(10).sum())",
    "compute50ms": "s = 0\nfor i in range(600_000):\n    s += i * i\nprint(s)",
}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bare_run(code: str) -> float:
    """ARPO's python tool: a cold interpreter per call."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return time.perf_counter() - start


def bench_bare(code: str, concurrency: int, calls: int) -> dict[str, float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        lat = list(pool.map(lambda _: bare_run(code), range(calls)))
    wall = time.perf_counter() - start
    return {"calls_per_s": calls / wall, "p50_ms": _pct(lat, 0.5) * 1e3, "p99_ms": _pct(lat, 0.99) * 1e3}


async def bench_sandbox(tool, code: str, concurrency: int, calls: int) -> dict[str, float]:
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []

    async def one():
        async with sem:
            t = time.perf_counter()
            r = await tool.call(code)
            lat.append(time.perf_counter() - t)
            assert r.ok, r

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(calls)))
    wall = time.perf_counter() - start
    return {"calls_per_s": calls / wall, "p50_ms": _pct(lat, 0.5) * 1e3, "p99_ms": _pct(lat, 0.99) * 1e3}


def sandbox_section(quick: bool) -> tuple[list[dict], dict[str, float]]:
    from appo_trl.tools import PythonTool

    tool = PythonTool(timeout_s=30)
    t0 = time.perf_counter()
    tool.start()
    startup = time.perf_counter() - t0
    rows = []

    async def run_all():
        for _ in range(10):  # warm-up
            await tool.call("print(1)")
        for name, code in SNIPPETS.items():
            for conc in (1, 8, 32):
                n = (
                    {"print": 300, "numpy": 96, "compute50ms": 64}[name]
                    if not quick
                    else {"print": 32, "numpy": 8, "compute50ms": 8}[name]
                )
                n = max(n, conc)
                sb = await bench_sandbox(tool, code, conc, n)
                bare = await asyncio.to_thread(
                    bench_bare, code, conc, max(conc, n // 3 if name == "print" else n // 2)
                )
                rows.append({"snippet": name, "concurrency": conc, "sandbox": sb, "bare": bare})
        await tool.aclose()

    asyncio.run(run_all())
    return rows, {"sandbox_startup_s": startup, "isolation": tool.sandbox.isolation}


LAYERS = ("pidns", "mounts", "ipc", "userns", "seccomp", "cgroups")
LAYER_NAMES = {
    "pidns": "+ pid namespace per call",
    "mounts": "+ mount namespace, 3 tmpfs, own /proc",
    "ipc": "+ ipc namespace",
    "userns": "+ user namespace, per-call uid, caps dropped",
    "seccomp": "+ seccomp filter",
    "cgroups": "+ per-call cgroups (memory, pids)",
}


def _started_tools(specs: list[tuple[str, tuple[str, ...]]]) -> list:
    """One started `PythonTool` per (isolation, layers left out) pair (the skip list is for benchmarks only)."""
    from appo_trl.tools import PythonTool

    tools = []
    for isolation, skip in specs:
        tool = PythonTool(timeout_s=30, isolation=isolation)
        tool.sandbox._skip_layers = tuple(skip)
        tool.start()
        tools.append(tool)
    return tools


def layers_section(quick: bool) -> list[dict]:
    """p50 of `print(1+1)` (concurrency 1) with the isolation layers added one at a time."""

    variants = [("unisolated fork server (isolation: none)", "none", LAYERS)]
    variants.append(("bubblewrap box, no per-call layer", "bwrap", LAYERS))
    for i, layer in enumerate(LAYERS):
        variants.append((LAYER_NAMES[layer], "bwrap", LAYERS[i + 1 :]))
    if quick:  # seconds, not minutes: the two ends only
        variants = [variants[0], variants[1], ("+ every per-call layer (full isolation)", "bwrap", ())]
    tools = _started_tools([(isolation, skip) for _, isolation, skip in variants])
    lat: list[list[float]] = [[] for _ in variants]

    async def measure():
        for tool in tools:
            for _ in range(5):
                await tool.call("print(1)")
        for _ in range(2 if quick else 8):
            for i, tool in enumerate(tools):
                for _ in range(5 if quick else 25):
                    t = time.perf_counter()
                    r = await tool.call("print(1+1)")
                    lat[i].append(time.perf_counter() - t)
                    assert r.ok, r
        for tool in tools:
            await tool.aclose()

    asyncio.run(measure())
    rows, prev = [], None
    for (name, _, _), values in zip(variants, lat):
        p50 = _pct(values, 0.5) * 1e3
        rows.append({"layer": name, "p50_ms": p50, "delta_ms": None if prev is None else p50 - prev})
        prev = p50
    return rows


def preload_section(quick: bool) -> list[dict]:
    """`print(1+1)` with numpy and sympy preloaded by the template (the default) vs by the zygote itself, which
    then forks every call: fork and copy-on-write cost grow with the forking process's memory."""

    variants = [("template holds numpy, sympy (default)", ()), ("zygote holds numpy, sympy", ("template",))]
    tools = _started_tools([("bwrap", skip) for _, skip in variants])
    res: list[dict[str, list[float]]] = [{"p50": [], "cps": []} for _ in variants]

    async def measure():
        for tool in tools:
            for _ in range(10):
                await tool.call("print(1)")
        for _ in range(2 if quick else 5):
            for i, tool in enumerate(tools):
                res[i]["p50"].append((await bench_sandbox(tool, "print(1+1)", 1, 20 if quick else 60))["p50_ms"])
                res[i]["cps"].append((await bench_sandbox(tool, "print(1+1)", 8, 40 if quick else 160))["calls_per_s"])
        for tool in tools:
            await tool.aclose()

    asyncio.run(measure())
    return [{"variant": name, "p50_ms": statistics.median(r["p50"]), "calls_per_s_c8": statistics.median(r["cps"])}
            for (name, _), r in zip(variants, res)]  # fmt: skip


def make_corpus(path: str, n_docs: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocab = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(30_000)
    ]
    weights = [1.0 / (i + 1) for i in range(len(vocab))]  # Zipf-like word frequencies
    with open(path, "w") as fh:
        for i in range(n_docs):
            words = rng.choices(vocab, weights, k=60)
            fh.write(json.dumps({"id": str(i), "title": " ".join(words[:4]), "text": " ".join(words[4:])}) + "\n")
    return [" ".join(rng.choices(vocab[100:5000], k=4)) for _ in range(2000)]


def search_section(quick: bool) -> dict[str, float]:
    import httpx

    from appo_trl.tools.search import SearchTool
    from appo_trl.tools.search_server import BM25Index

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        n_docs = 10_000 if quick else 100_000
        queries = make_corpus(corpus, n_docs)
        t = time.perf_counter()
        BM25Index(corpus)
        out["search_docs"] = n_docs
        out["search_index_build_s"] = time.perf_counter() - t
        t = time.perf_counter()
        BM25Index(corpus)
        out["search_index_load_s"] = time.perf_counter() - t

        import socket

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        url = f"http://127.0.0.1:{port}/retrieve"
        # the server runs in its own process, as `appo serve-search` does (in-process, client and server share a GIL)
        server = subprocess.Popen(
            [sys.executable, "-m", "appo_trl.cli", "serve-search", "--corpus", corpus, "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            with httpx.Client(timeout=60, trust_env=False) as client:
                while True:
                    try:
                        client.get(url.replace("/retrieve", "/health")).raise_for_status()
                        break
                    except httpx.TransportError:
                        if server.poll() is not None:
                            raise RuntimeError("appo serve-search exited") from None
                        time.sleep(0.1)
                nq = 512 if quick else 2000
                batch = 64
                t = time.perf_counter()
                for i in range(0, nq, batch):
                    r = client.post(url, json={"queries": queries[i : i + batch], "topk": 10, "return_scores": True})
                    r.raise_for_status()
                out["search_qps"] = nq / (time.perf_counter() - t)
                single = 100 if quick else 300
                t = time.perf_counter()
                for q in queries[:single]:
                    client.post(url, json={"queries": [q], "topk": 10}).raise_for_status()
                out["search_qps_unbatched"] = single / (time.perf_counter() - t)
        finally:
            server.terminate()
            server.wait(30)

        tool = SearchTool(backend="cache", cache_path=os.path.join(tmp, "cache.sqlite"))
        items = ((f"query number {i}", f"Page 1: result {i}") for i in range(10_000))
        tool.cache.put_many(items, scope=tool._scope(), source="bench-corpus")  # what a cache-only tool replays

        async def hits():
            lat = []
            for i in range(2000):
                t = time.perf_counter()
                r = await tool.call(f"Query Number {i * 7 % 10_000}")
                lat.append(time.perf_counter() - t)
                assert r.ok and r.meta["cache_hit"]
            await tool.aclose()
            return lat

        lat = asyncio.run(hits())
        out["cache_hit_ms"] = statistics.median(lat) * 1e3
        out["cache_hit_p99_ms"] = _pct(lat, 0.99) * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small run (fewer calls, 10k-document corpus)")
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures as the last line")
    p.add_argument("--skip-search", action="store_true")
    p.add_argument("--skip-layers", action="store_true", help="do not measure the cost of each isolation layer")
    args = p.parse_args(argv)

    rows, info = sandbox_section(args.quick)
    print(f"# python sandbox vs bare `python -c` ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"isolation={info['isolation']}, zygote start {info['sandbox_startup_s']:.2f}s)")  # fmt: skip
    print(f"{'snippet':<12} {'conc':>4} | {'sandbox c/s':>11} {'p50 ms':>7} {'p99 ms':>7} | {'bare c/s':>8} "
          f"{'p50 ms':>7} {'p99 ms':>7} | {'x c/s':>6} {'x p50':>6}")  # fmt: skip
    for r in rows:
        sb, bare = r["sandbox"], r["bare"]
        r["speedup_calls_per_s"] = sb["calls_per_s"] / bare["calls_per_s"]
        r["speedup_p50"] = bare["p50_ms"] / sb["p50_ms"]
        print(f"{r['snippet']:<12} {r['concurrency']:>4} | {sb['calls_per_s']:>11.1f} {sb['p50_ms']:>7.1f} {sb['p99_ms']:>7.1f} | "
              f"{bare['calls_per_s']:>8.1f} {bare['p50_ms']:>7.1f} {bare['p99_ms']:>7.1f} | "
              f"{r['speedup_calls_per_s']:>6.1f} {r['speedup_p50']:>6.1f}")  # fmt: skip
    figures: dict[str, object] = dict(info)
    p1 = next(r for r in rows if r["snippet"] == "print" and r["concurrency"] == 1)
    best = max((r for r in rows if r["snippet"] == "print"), key=lambda r: r["sandbox"]["calls_per_s"])
    figures["sandbox_p50_ms"] = p1["sandbox"]["p50_ms"]
    figures["sandbox_calls_per_s"] = best["sandbox"]["calls_per_s"]
    figures["bare_p50_ms"] = p1["bare"]["p50_ms"]
    figures["speedup_vs_bare"] = best["sandbox"]["calls_per_s"] / max(
        r["bare"]["calls_per_s"] for r in rows if r["snippet"] == "print"
    )
    figures["rows"] = rows
    if not args.skip_layers:
        layers = layers_section(args.quick)
        print("# isolation layers, print(1+1) p50 at concurrency 1 (cumulative)")
        for row in layers:
            delta = "" if row["delta_ms"] is None else f" ({row['delta_ms']:+.2f})"
            print(f"{row['layer']:<48} {row['p50_ms']:7.2f} ms{delta}")
        figures["layers"] = layers
    if not args.skip_layers:
        pre = preload_section(args.quick)
        print("# fork parent: print(1+1), p50 at concurrency 1 and calls/s at 8 (medians of rounds)")
        for row in pre:
            print(f"{row['variant']:<48} {row['p50_ms']:7.2f} ms {row['calls_per_s_c8']:7.1f} calls/s")
        figures["preload"] = pre
    if not args.skip_search:
        s = search_section(args.quick)
        print(f"# search: {s['search_docs']:,} docs, index build {s['search_index_build_s']:.1f}s, "
              f"load {s['search_index_load_s']:.2f}s, {s['search_qps']:.0f} queries/s batched (64/request), "
              f"{s['search_qps_unbatched']:.0f} queries/s one per request, cache hit p50 {s['cache_hit_ms']:.3f} ms "
              f"(p99 {s['cache_hit_p99_ms']:.3f} ms)")  # fmt: skip
        figures.update(s)
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
