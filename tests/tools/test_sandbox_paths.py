"""Where the interpreter lives must not matter: a venv under `/tmp` (a CI clone made with `mktemp -d`) is hidden
by the sandbox's private `/tmp` unless it is bound back, read-only, on top of it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = r"""
import asyncio, json, sys
from appo_trl.tools.python_sandbox import PythonTool, PythonToolConfig
tool = PythonTool(PythonToolConfig(timeout_s=20, preload=("math",)))
tool.start()
async def go():
    out = {}
    for name, code in [("six", "print(6*7)"), ("yaml", "import yaml\nprint(yaml.safe_load('a: 1'))"),
                       ("write", f"open({sys.prefix!r} + '/evil.pth', 'w')"), ("tmp", "import os\nprint(os.listdir('/tmp'))")]:
        r = await tool.call(code)
        out[name] = [r.ok, r.text]
    await tool.aclose()
    return out
print("RESULT " + json.dumps({"prefix": sys.prefix, "calls": asyncio.run(go())}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="binds the venv under /tmp as root")
def test_a_venv_under_tmp_is_visible_to_calls_read_only():
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    top = tempfile.mkdtemp(prefix="appo-venv-", dir="/tmp")
    venv = os.path.join(top, "venv")
    os.mkdir(venv)
    try:  # the test's own venv, seen at a path under /tmp in a private mount namespace
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
               'mount --bind "$1" "$2" && cd "$3" && exec "$2/bin/python" -c "$4"',
               "sh", sys.prefix, venv, repo, SCRIPT]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": repo}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-2000:]
    res = json.loads(line[len("RESULT ") :])
    assert res["prefix"] == venv
    calls = res["calls"]
    assert calls["six"] == [True, "42"]
    assert calls["yaml"] == [True, "{'a': 1}"]  # a package from the venv under /tmp imports in a call
    assert not calls["write"][0] and "Read-only file system" in calls["write"][1]
    assert calls["tmp"] == [
        True,
        "['appo-venv-" + top.rsplit("appo-venv-", 1)[1] + "']",
    ]  # nothing else of the host /tmp
