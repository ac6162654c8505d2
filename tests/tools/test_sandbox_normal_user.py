"""The sandbox when the trainer is a normal user (uid 65534 here, dropped to from root with `setpriv`): bubblewrap
then maps that uid alone, there are no delegated cgroups, and the per-call limits are rlimits. The same attacks
as in test_sandbox_attacks.py must fail. The test's venv and checkout are bound, read-only, at a place that user
can read, in a private mount namespace (a CI clone under a 0700 `mktemp -d` directory is not)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.timeout(120)

USER = 65534
SCRIPT = r"""
import asyncio, json, os, sys
from appo_trl.tools.python_sandbox import PythonTool, PythonToolConfig
tool = PythonTool(PythonToolConfig(timeout_s=10, max_processes=16, preload=("math",)))
tool.start()
home, port, trainer = os.environ["HOME"], int(sys.argv[1]), os.getpid()
CODE = {
    "ids": "import os\nprint(os.getuid(), os.geteuid())",
    "status": "print(''.join(l for l in open('/proc/self/status') if l.startswith(('CapEff', 'NoNewPrivs', 'Seccomp'))))",
    "env": "import os\nprint(sorted(k for k in os.environ if 'SECRET' in k or 'TOKEN' in k))",
    "home": f"print(open({home!r} + '/.netrc').read())",
    "trainer": f"import os\nos.kill({trainer}, 0)",
    "net": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
    "threads": "import threading, time\n[threading.Thread(target=time.sleep, args=(3,)).start() for _ in range(64)]",
    "leave": "open('/tmp/mark', 'w').write('x')\nprint('ok')",
    "find": "import os\nprint(os.path.exists('/tmp/mark'))",
    "ptrace": "import ctypes\nprint(ctypes.CDLL(None, use_errno=True).ptrace(16, 1, 0, 0), ctypes.get_errno())",
}
async def go():
    out = {}
    for name, code in CODE.items():
        r = await tool.call(code)
        out[name] = [r.ok, r.text]
    await tool.aclose()
    return out
print("RESULT " + json.dumps({"uid": os.getuid(), "calls": asyncio.run(go())}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")),
                    reason="drops from root to a normal user")  # fmt: skip
def test_attacks_fail_when_the_trainer_is_a_normal_user():
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    top = tempfile.mkdtemp(prefix="appo-user-", dir="/tmp")
    os.chmod(top, 0o755)
    home = os.path.join(top, "home")
    for d in ("venv", "repo", "home"):
        os.mkdir(os.path.join(top, d))
    with open(os.path.join(home, ".netrc"), "w") as fh:
        fh.write("machine hub password hf_secret_token\n")
    os.chown(home, USER, USER)
    os.chown(os.path.join(home, ".netrc"), USER, USER)
    os.chmod(os.path.join(home, ".netrc"), 0o600)
    server = socket.create_server(("127.0.0.1", 0))  # a host service the code must not reach (vLLM, search)
    mounts = 'mount --bind "$1" "$3/venv" && mount -o remount,bind,ro "$3/venv" && mount --bind "$2" "$3/repo" && ' \
             'mount -o remount,bind,ro "$3/repo"'  # fmt: skip
    base, blocked = os.path.realpath(sys.base_prefix), _closed_ancestor(os.path.realpath(sys.base_prefix))
    if blocked:  # e.g. a pyenv interpreter under /root (0700): show the user an open /root holding it alone
        os.mkdir(os.path.join(top, "base"))
        mounts += f' && mount --bind "{base}" "$3/base" && mount -t tmpfs -o mode=755 tmpfs "{blocked}" && ' \
                  f'mkdir -p "{base}" && mount --bind "$3/base" "{base}"'  # fmt: skip
    mounts += (
        ' && cd "$3/repo" && exec setpriv --reuid 65534 --regid 65534 --clear-groups "$3/venv/bin/python" -c "$4" "$5"'
    )
    cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", mounts, "sh", sys.prefix, repo, top, SCRIPT,
           str(server.getsockname()[1])]  # fmt: skip
    env = {"PATH": os.environ["PATH"], "HOME": home, "PYTHONPATH": os.path.join(top, "repo"), "HF_HUB_OFFLINE": "1",
           "HF_TOKEN": "hf_secret_env", "MY_SECRET": "s3cr3t"}  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    finally:
        server.close()
        shutil.rmtree(top, ignore_errors=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    res = json.loads(line[len("RESULT ") :])
    assert res["uid"] == USER  # the trainer itself is the normal user
    c = res["calls"]
    assert c["ids"] == [True, "65534 65534"]  # the call runs unprivileged
    status = dict(x.split(":\t") for x in c["status"][1].splitlines())
    assert {k: status[k] for k in ("CapEff", "NoNewPrivs", "Seccomp")} == {
        "CapEff": "0000000000000000",
        "NoNewPrivs": "1",
        "Seccomp": "2",
    }
    assert c["env"] == [True, "[]"]  # the trainer's secrets are not in the call's environment
    assert not c["home"][0] and "hf_secret_token" not in c["home"][1]  # nor its home
    assert not c["trainer"][0] and "ProcessLookupError" in c["trainer"][1]  # the trainer's pid is not there
    assert not c["net"][0]  # no route to the host's loopback services
    assert not c["threads"][0] and "can't start new thread" in c["threads"][1]  # rlimits count threads per call
    assert c["leave"] == [True, "ok"] and c["find"] == [True, "False"]  # nothing carries over between calls
    assert c["ptrace"] == [True, "-1 1"]  # EPERM from the seccomp filter


def _closed_ancestor(path: str) -> str | None:
    """The first directory above `path` that other users cannot traverse, if any."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts)):
        d = "/" + "/".join(parts[:i])
        if not os.stat(d).st_mode & 0o001:
            return d
    return None
