"""`bench/rollout.py` runs end to end on a tiny workload and both schedules see the same token streams."""

from __future__ import annotations

import json

from bench.rollout import main


def test_bench_rollout_tiny_run(capsys):
    out = main(["--prompts", "3", "--n", "2", "--decode-ms", "0.05", "--json"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == out
    assert out["same_token_streams"] is True and out["tokens_sampled"] > 0
    assert {"speedup_vs_barrier", "prefix_tokens_saved_ratio", "tokens_per_s_async"} <= set(out)
    assert out["branches"] == 6 and 0 < out["prefix_tokens_reused"]
