"""`appo train` with an agent: a taken `agent_port` and `agent_errors: raise` each end in one line (issue 40 #8).

Before: a taken port was a 29-frame `OSError: [Errno 98]` after the model loaded (not naming `agent_port`) that left an
empty `output_dir`; `agent_errors: raise` a 36-frame traceback without an `appo train: error:` line.
"""

from __future__ import annotations

import json
import socket

import pytest
import yaml

from appo_trl.cli import main as appo
from tests.test_cli_errors import one_error_line, recipe, workdir  # noqa: F401 - the fixture

pytest.importorskip("openai")

AGENT = """import openai

def agent(row, base_url, model):
    raise ValueError("the sandbox broke")
"""


def test_a_taken_agent_port_is_one_line_before_the_model_loads(workdir, capfd):  # noqa: F811
    (workdir / "my_agent.py").write_text(AGENT)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        config = recipe(workdir, agent="my_agent:agent", agent_port=port)  # the model folder cannot load
        assert appo(["train", "--config", config]) == 2
    line = one_error_line(capfd)
    assert line.startswith(f"appo train: error: agent_port={port} cannot be used on agent_host='127.0.0.1': ")
    assert "in use" in line and not (workdir / "out").exists()


def test_agent_errors_raise_ends_in_one_line_naming_the_error_and_the_checkpoint(tmp_path, monkeypatch, capfd,
                                                                                   tiny_chat_model_path):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_agent.py").write_text(AGENT)
    rows = [{"prompt": [{"role": "user", "content": f"What is {i}+1?"}], "answer": str(i + 1)} for i in range(4)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"output_dir": "out", "use_cpu": True, "bf16": False, "report_to": "none", "num_generations": 4,
              "per_device_train_batch_size": 4, "max_steps": 2, "max_completion_length": 8,
              "model_name_or_path": tiny_chat_model_path, "dataset_name": "data.jsonl", "agent": "my_agent:agent",
              "agent_errors": "raise"}  # fmt: skip
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(config))
    assert appo(["train", "--config", str(tmp_path / "r.yaml")]) == 1
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("appo train: error:")]
    assert "Traceback" not in err and len(errors) == 1
    assert errors[0] == ("appo train: error: agent 'agent' failed: ValueError: the sandbox broke (agent_errors: raise); "
                         "no checkpoint was saved in out yet (run with --debug for the traceback)")  # fmt: skip
