"""`appo train` with an agent never logs the endpoint's secret: request loggers stay at WARNING, and an agent's error
quoting its base URL is logged with the secret replaced.

A subprocess run (the CLI's own logging setup, as a user sees it): the tiny chat model, 1 grpo step, an `openai` SDK
agent named in the recipe that fails for one prompt with its `base_url` in the message.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("openai")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT = """
import openai


def agent(row, base_url, model):
    client = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0)
    client.chat.completions.create(model=model, messages=row["prompt"], max_tokens=4)
    client.close()
    if "(0)" in str(row["prompt"]):
        raise RuntimeError(f"the tool server behind {base_url} refused")
    return 0.5
"""


def test_appo_train_logs_no_secret(tmp_path, tiny_chat_model_path):
    (tmp_path / "my_agent.py").write_text(AGENT)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"what is 6 times 7 ({i})", "answer": "42"})
                                                 + "\n" for i in range(2)))  # fmt: skip
    recipe = {"model_name_or_path": tiny_chat_model_path, "dataset_name": str(tmp_path / "data.jsonl"),
              "agent": "my_agent:agent", "rollout_strategy": "grpo", "max_steps": 1, "num_generations": 2,
              "per_device_train_batch_size": 4, "max_completion_length": 16, "use_cpu": True, "bf16": False,
              "report_to": "none", "save_strategy": "no", "logging_steps": 1, "beta": 0.0,
              "output_dir": str(tmp_path / "out")}  # fmt: skip
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    env = {
        **os.environ,
        "PYTHONPATH": REPO,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
    }
    proc = subprocess.run([sys.executable, "-m", "appo_trl.cli", "train", "--config", str(tmp_path / "r.yaml")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    failed = [line for line in log.splitlines() if "the tool server behind" in line]
    assert failed and all(re.search(r"http://127\.0\.0\.1:\d+/\*\*\*/[0-9a-f]+/v1 refused", f) for f in failed), log
    assert "HTTP Request" not in log  # httpx's per-request INFO line, with the URL
    # no URL path segment that looks like the secret (22 url-safe characters) anywhere
    assert not re.search(r"127\.0\.0\.1:\d+/[A-Za-z0-9_-]{22}/", log), log[-3000:]


def test_error_lines_and_log_records_write_the_secret_as_stars(tiny_chat_tokenizer):
    """`appo train: error: ...` lines (`one_line`) and log records through the CLI's handler filter, also after the
    endpoint closed (an error raised out of `train()` is printed after its `finally` closed the endpoint)."""
    import logging

    from appo_trl.configs.errors import one_line
    from appo_trl.rollout.agent_endpoint import AgentEndpoint
    from appo_trl.rollout.agent_session import ChatRenderer
    from appo_trl.rollout.types import SamplingParams
    from appo_trl.stages.logs import RedactSecrets

    endpoint = AgentEndpoint(None, None, ChatRenderer(tiny_chat_tokenizer), SamplingParams(max_tokens=8), 64)
    url = endpoint.base_url("k")
    endpoint.close()
    line = one_line(f"RuntimeError: agent failed\n  at {url}")
    assert (
        endpoint.secret not in line and line == f"RuntimeError: agent failed; at {url.replace(endpoint.secret, '***')}"
    )
    try:
        raise RuntimeError(f"refused by {url}")
    except RuntimeError:
        import sys

        record = logging.LogRecord("x", logging.WARNING, __file__, 1, "agent at %s failed", (url,), sys.exc_info())
    assert RedactSecrets().filter(record)
    text = logging.Formatter().format(record)
    assert endpoint.secret not in text and text.count("/***/k/v1") == 2, text
