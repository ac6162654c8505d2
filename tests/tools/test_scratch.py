"""Scratch files (the `--skip_bad_rows` copy, the vLLM disk-sync folder, the router log) leave nothing in the temp
folder: removed at exit, and a killed run's removed at the next start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _child(tmp, code: str, kill: bool) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(tmp)}
    script = textwrap.dedent(code) + ("\nimport time; print('ready', flush=True); time.sleep(60)\n" if kill else "")
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    if kill:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    return proc


ROWS = """
from appo_trl.configs.rows import scan_json_file
path = scan_json_file({data!r}, skip=True)
assert path != {data!r} and "appo-rows-" in path, path
"""
SYNC_AND_LOG = """
import sys
from types import SimpleNamespace
import appo_trl.vllm.router as router
import appo_trl.vllm.weight_sync as ws

class Server:  # a healthy GPU server, without HTTP
    def __init__(self, url, timeout_s=0):
        pass
    def wait_healthy(self, timeout_s):
        pass
    def get_server_info(self):
        return {}

ws.ServerClient = Server
sync = object.__new__(ws.DiskWeightSync)
sync.mode, sync._urls, sync.server_timeout, sync._sync_dir_arg = "server", ["http://127.0.0.1:1"], 1, None
sync.adapter = False  # (what __init__ sets without LoRA)
sync.accelerator = SimpleNamespace(wait_for_everyone=lambda: None)
sync._init_vllm()
with open(sync.sync_dir + "/model.safetensors", "wb") as fh:
    fh.write(b"weights")
router.VLLMRouter.command = lambda self: [sys.executable, "-c", "import time; time.sleep(60)"]
router.RouterClient.list_workers = lambda self: list(self_urls)
self_urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
r = router.VLLMRouter(self_urls, port=1).start()
assert "appo-vllm-router-" in r.log_path
"""


def test_scratch_files_are_gone_after_a_run_and_a_killed_runs_at_the_next_start(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a"}\nnot json\n{"prompt": "b"}\n')
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    _child(tmp, ROWS.format(data=str(data)) + SYNC_AND_LOG, kill=True)
    left = sorted(n for n in os.listdir(tmp) if n.startswith("appo-"))  # (torch and wandb make their own)
    assert [n.split("-")[1] for n in left] == ["rows", "vllm", "vllm"]  # SIGKILL: no cleanup ran
    assert _child(tmp, ROWS.format(data=str(data)), kill=False).returncode == 0  # the next start, a normal exit
    assert [n for n in os.listdir(tmp) if n.startswith("appo-")] == []
