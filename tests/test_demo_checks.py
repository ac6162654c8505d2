"""scripts/demo_checks.py, the checks docs/benchmarks.md's demo run H quotes, on hand-made demo workdirs."""

from __future__ import annotations

import importlib.util
import json

import pytest

from appo_trl.configs.recipes import REPO_ROOT


def _module():
    spec = importlib.util.spec_from_file_location("demo_checks", REPO_ROOT / "scripts" / "demo_checks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _call(query, tag="python"):
    return {"tag": tag, "ok": True, "query": query, "latency_s": 0.01}


def test_heldout_counts_the_calls_that_copy_the_multiplier_by_hand(tmp_path, capsys):
    _write(tmp_path / "data" / "heldout.jsonl", [
        {"family": "both", "question": "What is the population of Velmora times 5?", "answer": ["2260"]},
        {"family": "python", "question": "What is 3 * 5?", "answer": ["15"]},
        {"family": "both", "question": "What is the population of Oskar times 7?", "answer": ["700"]},
    ])  # fmt: skip
    _write(tmp_path / "eval" / "step0" / "samples.jsonl", [
        {"index": 0, "tool_calls": [_call("Velmora population", "search"), _call("print(452 * 5)")]},
        {"index": 0, "tool_calls": [_call("print(452 * 7)")]},  # the collapse: 7 written for "times 5"
        {"index": 1, "tool_calls": [_call("print(3 * 5)")]},  # a python question: not counted
        {"index": 2, "tool_calls": [_call("print( 100 *7 )"), _call("print(len('x'))")]},  # no N * m: not a call
    ])  # fmt: skip
    _write(tmp_path / "eval" / "step40" / "samples.jsonl", [{"index": 0, "tool_calls": []}])
    _write(tmp_path / "eval" / "step120" / "samples.jsonl", [
        {"index": 0, "tool_calls": [_call("print(452 * 7)"), _call("print(452 * 7)")]},
    ])  # fmt: skip
    out = _module().heldout(tmp_path)
    assert list(out) == ["step0", "step40", "step120"]  # by step number, not by name
    assert out["step0"] == {"5": {"copied": 1, "calls": 2}, "7": {"copied": 1, "calls": 1}}
    assert out["step40"] == {}
    assert out["step120"] == {"5": {"copied": 0, "calls": 2}}
    assert "step0: k=5 1/2  k=7 1/1" in capsys.readouterr().out


def test_a_workdir_without_a_finished_demo_is_one_line(tmp_path):
    mod = _module()
    _write(tmp_path / "data" / "heldout.jsonl", [])
    with pytest.raises(SystemExit, match=r"no .*eval/step\*/samples.jsonl \(a finished `appo demo` writes them\)"):
        mod.heldout(tmp_path)
    with pytest.raises(SystemExit, match=r"report.json not found"):
        mod.main(["noise", str(tmp_path)])
    with pytest.raises(SystemExit):  # argparse: one seed gives no sd
        mod.main(["noise", str(tmp_path), "--seeds", "3"])


def test_seed_ranges():
    mod = _module()
    assert mod._seeds("100-103") == [100, 101, 102, 103]
    assert mod._seeds("7") == [7]
