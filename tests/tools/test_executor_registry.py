"""Executor (bounded concurrency, deadlines, metrics), tool registry, and the `appo tool` command."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from appo_trl.tools import PythonTool, SearchTool, ToolExecutor, ToolResult, build_tools

pytestmark = pytest.mark.timeout(60)


class SleepyTool:
    name = tag = "sleepy"

    def __init__(self):
        self.in_flight = self.peak = 0

    async def call(self, text: str) -> ToolResult:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if text == "boom":
                raise RuntimeError("tool bug")
            await asyncio.sleep(float(text))
            return ToolResult(f"slept {text}", truncated=text == "0.02", latency_s=0.5)
        finally:
            self.in_flight -= 1

    async def aclose(self):
        pass


def test_bounded_concurrency_deadline_errors_and_metrics():
    tool = SleepyTool()
    ex = ToolExecutor({"sleepy": tool}, max_workers=3, timeout_s=0.5)

    async def go():
        results = await asyncio.gather(*(ex.execute("sleepy", "0.02") for _ in range(9)))
        slow = await ex.execute("sleepy", "30")
        bug = await ex.execute("sleepy", "boom")
        unknown = await ex.execute("nope", "x")
        return results, slow, bug, unknown

    results, slow, bug, unknown = asyncio.run(go())
    assert tool.peak == 3 and all(r.ok for r in results)
    assert slow.error == "timeout" and bug.error == "exception" and unknown.error == "unknown_tool"
    m = ex.metrics()
    assert m["tools/sleepy/calls"] == 11 and m["tools/sleepy/failures"] == 2 and m["tools/sleepy/timeouts"] == 1
    assert m["tools/sleepy/truncated"] == 9 and m["tools/nope/calls"] == 1
    assert m["tools/calls"] == 12 and m["tools/failure_frequency"] == pytest.approx(3 / 12)
    assert m["tools/sleepy/latency_max_s"] >= 0.5
    ex.reset_metrics()
    assert ex.metrics()["tools/calls"] == 0


def test_python_calls_do_not_block_the_event_loop():
    tool = PythonTool(timeout_s=5, preload=("math",))
    ex = ToolExecutor({"python": tool}, max_workers=4)
    ticks = []

    async def ticker():
        for i in range(5):
            ticks.append(i)
            await asyncio.sleep(0.01)

    async def go():
        try:
            t = asyncio.ensure_future(ticker())
            r = await ex.execute("python", "import time\ntime.sleep(0.3)\nprint('done')")
            await t
            return r
        finally:
            await ex.aclose()

    r = asyncio.run(go())
    assert r.text == "done" and ticks == [0, 1, 2, 3, 4]


def test_build_tools_keyed_by_tag(tmp_path):
    tools = build_tools(["python", "search"], {"python": {"timeout_s": 5}, "search": {"backend": "cache",
                        "cache_path": str(tmp_path / "c.sqlite")}})  # fmt: skip
    assert set(tools) == {"python", "search"}
    assert isinstance(tools["python"], PythonTool) and tools["python"].config.timeout_s == 5
    assert isinstance(tools["search"], SearchTool) and tools["search"].config.backend == "cache"


@pytest.mark.parametrize(
    "names, config, message",
    [
        (["pyhton"], None, "unknown tool 'pyhton'; valid: python, search. Did you mean 'python'?"),
        (["python"], {"python": {"timeout": 5}}, "Did you mean 'timeout_s'?"),
        (["python"], {"python": {"timeout_s": -1}}, "timeout_s must be > 0"),
        (["python"], {"search": {"backend": "cache"}}, "not in tools"),
        (["search"], {"search": {"backend": "bing"}}, "valid: cache, local, web"),
    ],
)
def test_bad_config_fails_at_start_up(names, config, message):
    with pytest.raises(ValueError) as err:
        build_tools(names, config)
    assert message in str(err.value)


def test_web_search_without_key_fails_at_start_up(monkeypatch):
    monkeypatch.delenv("BRIGHTDATA_API_KEY", raising=False)
    with pytest.raises(ValueError, match="BRIGHTDATA_API_KEY"):
        build_tools(["search"], {"search": {"backend": "web", "cache": False}})


def test_cli_tool_python_and_search(capsys, monkeypatch, tmp_path, arpo_data_dir):
    from appo_trl.cli import main

    assert main(["tool", "python", "--code", "print(6*7)", "--set", "preload=[math]"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["text"] == "42" and set(out) >= {"ok", "text", "latency_s", "truncated", "error"}
    assert main(["tool", "python", "--code", "1/0", "--set", "preload=[]"]) == 0  # the error is data
    assert "ZeroDivisionError" in json.loads(capsys.readouterr().out)["text"]
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("print('from stdin')"))
    assert main(["tool", "python", "--set", "preload=[]"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == "from stdin"
    cache = os.path.join(arpo_data_dir, "search_cache.json")
    assert main(["tool", "search", "zzz unknown query", "--backend", "cache", "--cache-path", cache]) == 0
    assert json.loads(capsys.readouterr().out)["error"] == "not_in_cache"
    assert main(["tool", "python", "--code", "1", "--set", "timeout=3"]) == 2
    assert "timeout_s" in capsys.readouterr().err
    assert main(["tool", "sql"]) == 2


def test_cli_serve_search_build_only(corpus_file, capsys):
    from appo_trl.cli import main

    assert main(["serve-search", "--corpus", corpus_file, "--build-only"]) == 0
    assert "4 documents, index built" in capsys.readouterr().out
    assert main(["serve-search", "--corpus", corpus_file, "--build-only"]) == 0
    assert "index reused" in capsys.readouterr().out


def test_executor_survives_successive_event_loops():
    tool = SleepyTool()
    ex = ToolExecutor({"sleepy": tool}, max_workers=1)

    async def batch():
        return await asyncio.gather(*(ex.execute("sleepy", "0.01") for _ in range(3)))

    for _ in range(3):  # evaluation may call asyncio.run once per batch
        assert all(r.ok for r in asyncio.run(batch()))
    assert ex.metrics()["tools/sleepy/calls"] == 9 and tool.peak == 1
