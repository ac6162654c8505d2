"""`appo demo`'s curves.png and the held-out breakdown it draws: per-family pass@1, calls, the same reward both ways."""

from __future__ import annotations

import json

import pytest

from appo_trl.cli.demo_curves import family_series, moving_mean, plot_curves
from appo_trl.synthetic.pipeline import heldout_breakdown

REPORT = {
    "strategy": "appo", "seed": 0, "k": 4,
    "rl_history": [{"step": s, "reward": r, "calls": c} for s, r, c in ((1, 0.8, 1.0), (2, 0.6, 1.2), (3, 0.4, 1.3))],
    "eval": {
        "0": {"pass@1": 0.5, "pass@k": 0.8, "calls_per_sample": 0.9, "reward": 0.4,
              "by_family": {"python": 0.4, "search": 0.6, "both": 0.5}},
        "3": {"pass@1": 0.7, "pass@k": 0.85, "calls_per_sample": 1.3, "reward": 0.75,
              "by_family": {"python": 0.35, "search": 0.9, "both": 0.85}},
    },
}  # fmt: skip


def test_moving_mean_by_hand():
    assert moving_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_mean([2.0], 5) == [2.0]


def test_family_series_shows_a_family_that_falls_while_the_total_rises():
    fam = family_series(REPORT)
    assert list(fam) == ["both", "python", "search"]
    assert fam["python"] == ([0, 3], [40.0, 35.0])
    assert fam["search"][1] == pytest.approx([60.0, 90.0])


def test_curves_have_the_family_panel_and_the_reward_both_ways(tmp_path):
    out = tmp_path / "curves.png"
    drawn = plot_curves(REPORT, out)
    assert list(drawn) == ["training reward", "held-out accuracy", "held-out pass@1 per family", "tool calls"]
    assert drawn["held-out pass@1 per family"] == ["both", "python", "search"]
    assert drawn["training reward"] == ["training rows, per step", "training rows, mean of last 1 steps",
                                        "held-out samples, same reward"]  # fmt: skip
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a report from before the held-out reward was recorded: the training reward alone
    old = {**REPORT, "eval": {s: {k: v for k, v in e.items() if k != "reward"} for s, e in REPORT["eval"].items()}}
    assert plot_curves(old, tmp_path / "old.png")["training reward"] == drawn["training reward"][:2]


def test_heldout_breakdown_by_hand(tmp_path):
    rows = [{"question": "What is 2 * 3 + 1?", "answer": ["7"], "family": "python"},
            {"question": "What is the capital of Zorvex?", "answer": ["Kipzim"], "family": "search"}]  # fmt: skip
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps(r) + "\n" for r in rows))
    registry = tmp_path / "benchmarks.yaml"
    registry.write_text(json.dumps({"benchmarks": {"synthetic": {"path": str(heldout)}}}))
    py = "<think>x</think><python>print(2 * 3 + 1)</python> <result>\n7\n</result><answer>\\boxed{7}</answer>"
    both = ("<think>x</think><search>Zorvex capital</search> <result>\nPage 1: ...\n</result>"
            "<python>print(1)</python> <result>\n1\n</result><answer>\\boxed{Kipzim}</answer>")  # fmt: skip
    samples = [
        {"index": 0, "completion": py, "tool_calls": [{"tag": "python", "ok": True}]},  # right: 1.0
        {"index": 0, "completion": "<think>x</think><answer>\\boxed{8}</answer>", "tool_calls": []},  # wrong: 0.0
        {"index": 1, "completion": both, "tool_calls": [{"tag": "search"}, {"tag": "python"}]},  # right, both: 1.1
        {"index": 1, "completion": "<answer>\\boxed{Kipzim}</answer>", "tool_calls": []},  # no <think>: -1.0
    ]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    b = heldout_breakdown(str(tmp_path), str(registry))
    # eval's em ignores the format (the last sample is right), the training reward does not
    assert b["by_family"] == {"python": 0.5, "search": 1.0}
    assert b["calls_by_family"] == {"python": {"python": 0.5, "search": 0.0}, "search": {"python": 0.5, "search": 0.5}}
    assert b["reward"] == pytest.approx((1.0 + 0.0 + 1.1 - 1.0) / 4)
