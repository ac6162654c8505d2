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
    os.mkdir(home)
    with open(os.path.join(home, ".netrc"), "w") as fh:
        fh.write("machine hub password hf_secret_token\n")
    os.chown(home, USER, USER)
    os.chown(os.path.join(home, ".netrc"), USER, USER)
    os.chmod(os.path.join(home, ".netrc"), 0o600)
    server = socket.create_server(("127.0.0.1", 0))  # a host service the code must not reach (vLLM, search)
    mounts = _expose(top, [repo, sys.prefix, sys.base_prefix])
    mounts += (
        f' && cd "{repo}" && exec setpriv --reuid {USER} --regid {USER} --clear-groups "{sys.executable}" -c "$1" "$2"'
    )
    cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", mounts, "sh", SCRIPT, str(server.getsockname()[1])]
    env = {"PATH": os.environ["PATH"], "HOME": home, "PYTHONPATH": repo, "HF_HUB_OFFLINE": "1",
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


def _expose(top: str, paths: list[str]) -> str:
    """Shell commands (for a private mount namespace) that let other users reach `paths` where they are: the
    first directory on the way that others cannot traverse (a 0700 `mktemp -d` clone, a pyenv under 0700
    `/root`) is covered by a 0755 tmpfs, on which the path (or, when it is that directory, its entries) is bound
    back from a side copy under `top`."""
    paths = sorted({os.path.realpath(p) for p in paths})
    paths = [p for p in paths if not any(p.startswith(q + "/") for q in paths)]
    restore: dict[str, list[str]] = {}  # closed directory -> what to bind back onto its tmpfs
    for p in paths:
        parts = p.strip("/").split("/")
        chain = ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        closed = next((d for d in chain if not os.stat(d).st_mode & 0o001), None)
        if closed is not None:
            items = [os.path.join(p, e) for e in os.listdir(p)] if closed == p else [p]
            restore.setdefault(closed, []).extend(items)
    cmds = ["umask 022"]
    for k, (closed, items) in enumerate(sorted(restore.items())):
        sides = []
        for j, item in enumerate(items):
            side = os.path.join(top, f"side{k}-{j}")
            os.mkdir(side) if os.path.isdir(item) else open(side, "w").close()
            sides.append(side)
            cmds.append(f'mount --bind "{item}" "{side}"')
        cmds.append(f'mount -t tmpfs -o mode=755 tmpfs "{closed}"')
        for item, side in zip(items, sides):
            make = (
                f'mkdir -p "{item}"'
                if os.path.isdir(side)
                else f'mkdir -p "{os.path.dirname(item)}" && touch "{item}"'
            )
            cmds += [make, f'mount --bind "{side}" "{item}"']
    return " && ".join(cmds)
