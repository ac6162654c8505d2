"""The python sandbox under attack, as root (how CI and most GPU containers run): one test per observed attack.

Each snippet is what a hostile sample did against the earlier sandbox, where it worked; here each must be
contained, and the sandbox must still answer `print(6*7)` afterwards (`run`). Attacks on the control plane and
the trainer's survival are in `test_sandbox_protocol.py`, resource limits and residue in
`test_sandbox_limits.py`.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import site
import socket
import subprocess
import sys
import sysconfig

import pytest

from appo_trl.tools.python_sandbox import PythonTool, PythonToolConfig
from tests.tools.conftest import assert_alive, running_python_tool

pytestmark = pytest.mark.timeout(120)

CONFIG = PythonToolConfig(timeout_s=5.0, memory_mb=1024, file_size_mb=1, max_processes=32, max_output_chars=2000,
                          max_output_bytes=64 * 1024)  # fmt: skip
UMOUNT_PROC = "import ctypes\nctypes.CDLL(None).umount2(b'/proc', 2)\n"


@pytest.fixture(scope="module")
def tool():
    with running_python_tool(CONFIG) as t:
        yield t


alive = assert_alive


def run(tool, code):
    result = asyncio.run(tool.call(code))
    alive(tool, code)
    return result


def test_children_are_unprivileged_and_in_their_own_namespaces(tool):
    host = {ns: os.stat(f"/proc/self/ns/{ns}").st_ino for ns in ("user", "pid", "net", "ipc", "uts", "mnt")}
    code = (
        "import os\nst = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines() if ':' in l)\n"
        "print({k: st[k].strip() for k in ('CapEff', 'CapPrm', 'CapBnd', 'CapAmb', 'NoNewPrivs', 'Seccomp')})\n"
        "print({ns: os.stat(f'/proc/self/ns/{ns}').st_ino for ns in ('user', 'pid', 'net', 'ipc', 'uts', 'mnt')})\n"
        "print(os.getuid(), os.geteuid(), os.getgid())"
    )
    r = run(tool, code)
    lines = r.text.splitlines()
    status, namespaces = eval(lines[0]), eval(lines[1])  # noqa: S307 - dict literals printed by our snippet
    assert status == {"CapEff": "0" * 16, "CapPrm": "0" * 16, "CapBnd": "0" * 16, "CapAmb": "0" * 16,
                      "NoNewPrivs": "1", "Seccomp": "2"}  # fmt: skip
    assert all(namespaces[ns] != host[ns] for ns in host), (namespaces, host)
    assert lines[2] == "65534 65534 65534"


def test_concurrent_calls_run_as_distinct_unprivileged_host_ids(tool):
    if os.geteuid() != 0:
        pytest.skip("per-call host uids need root")
    code = "import time\ntime.sleep(0.5)\nprint(open('/proc/self/uid_map').read().split()[1])"

    async def many():
        return await asyncio.gather(*(tool.call(code) for _ in range(4)))

    outer = [int(r.text) for r in asyncio.run(many())]
    assert len(set(outer)) == 4 and 0 not in outer


def test_seccomp_denies_namespace_and_tracing_syscalls(tool):
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "def err(ret):\n    return os.strerror(ctypes.get_errno()) if ret == -1 else 'ALLOWED'\n"
        "print('ptrace', err(libc.ptrace(0, 0, 0, 0)))\n"  # PTRACE_TRACEME: allowed without a filter
        "print('unshare', err(libc.unshare(0x10000000)))\n"  # CLONE_NEWUSER: allowed to anyone without a filter
        "print('setns', err(libc.setns(-1, 0)))\n"  # EBADF without a filter
        "print('bpf', err(libc.syscall(321, 0, 0, 0)))\n"
        "print('perf_event_open', err(libc.syscall(298, 0, 0, -1, -1, 0)))\n"
        "print('process_vm_readv', err(libc.syscall(310, 1, 0, 0, 0, 0, 0)))\n"
    )
    if os.uname().machine != "x86_64":
        pytest.skip("syscall numbers are x86_64's")
    r = run(tool, code)
    assert r.ok, r.text
    for line in r.text.splitlines():
        assert line.split(" ", 1)[1] == "Operation not permitted", line


def test_home_and_project_secrets_are_not_readable(tmp_path, monkeypatch):
    """`~/.netrc`, `~/.cache/huggingface/token`, `~/.config/wandb/settings` and `./.env` of the trainer."""
    home, project = tmp_path / "home", tmp_path / "project"
    files = [home / ".netrc", home / ".cache/huggingface/token", home / ".config/wandb/settings", project / ".env"]
    for path in files:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("SECRET-" + secrets.token_hex(8))
    os.chmod(project / ".env", 0o644)  # world-readable, as such files usually are
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(project)
    t = PythonTool(CONFIG)
    try:
        code = (
            f"paths = {[str(p) for p in files]!r}\n"
            "import os\npaths += [os.path.expanduser('~/.netrc'), '/root/.netrc', '/root/.cache/huggingface/token']\n"
            "for p in paths:\n    try:\n        data = open(p).read()\n    except OSError:\n        continue\n"
            "    print('LEAK', p, data[:20])\n"
            "print('home', sorted(os.listdir('/root')) if os.path.isdir('/root') else None)\nprint('checked')"
        )
        r = run(t, code)
    finally:
        asyncio.run(t.aclose())
    assert "LEAK" not in r.text and "SECRET-" not in r.text and r.text.endswith("checked"), r.text
    listing = r.text.splitlines()[-2]
    assert listing in ("home None", "home []", "home ['.pyenv']"), listing  # at most the python installation


def test_trainer_environ_and_memory_are_unreachable_even_after_umount(tool):
    secret = "hf_" + secrets.token_hex(12)
    victim = subprocess.Popen(["sleep", "60"], env={"HF_TOKEN": secret})
    try:
        code = UMOUNT_PROC + (
            "import glob\n"
            f"for pid in ({victim.pid}, {os.getpid()}):\n"
            "    try:\n        data = open(f'/proc/{pid}/environ', 'rb').read()\n        print('ENVIRON', pid, len(data))\n"
            "    except OSError:\n        pass\n"
            "    try:\n        open(f'/proc/{pid}/mem', 'r+b')\n        print('MEM', pid)\n    except OSError:\n        pass\n"
            "for p in glob.glob('/proc/*/environ'):\n"
            f"    try:\n        if b'{secret}' in open(p, 'rb').read():\n            print('LEAK', p)\n"
            "    except OSError:\n        pass\n"
            "print('checked')"
        )
        r = asyncio.run(tool.call(code))
    finally:
        victim.kill()
        victim.wait()
    assert r.text.splitlines() == ["checked"], r.text
    alive(tool, code)  # and the umount attempt did not break later calls


def test_setns_into_the_trainers_network_cannot_reach_loopback_servers(tool):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = UMOUNT_PROC + (
        "import os, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"for pid in ({os.getpid()}, 1):\n"
        "    try:\n        fd = os.open(f'/proc/{pid}/ns/net', os.O_RDONLY)\n"
        "        print('setns', pid, libc.setns(fd, 0x40000000))\n    except OSError:\n        pass\n"
        f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('CONNECTED')\n"
        "except OSError as e:\n    print('refused', e)"
    )
    try:
        r = asyncio.run(tool.call(code))
    finally:
        server.close()
    assert "CONNECTED" not in r.text and "setns 0" not in r.text.replace(f"setns {os.getpid()} -1", ""), r.text
    alive(tool, code)


def test_host_unix_sockets_are_unreachable(tool):
    path = f"/tmp/appo-test-{secrets.token_hex(6)}.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    code = (
        f"import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect({path!r})\n    print('CONNECTED')\n"
        "except OSError as e:\n    print('refused', e.errno)"
    )
    try:
        r = run(tool, code)
    finally:
        server.close()
        os.unlink(path)
    assert "CONNECTED" not in r.text and r.text.startswith("refused"), r.text


def test_sethostname_is_refused(tool):
    code = "import socket\ntry:\n    socket.sethostname(socket.gethostname())\n    print('CHANGED')\nexcept OSError as e:\n    print(e)"
    r = run(tool, code)
    assert "CHANGED" not in r.text and "Operation not permitted" in r.text, r.text


def test_site_packages_cannot_be_written(tool):
    """A `.pth` file or a module shadowing a real one (`yaml.py`) in site-packages would run in later calls."""
    name = f"appo_probe_{secrets.token_hex(6)}"
    dirs = sorted({*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"]})
    code = (
        f"for d in {dirs!r}:\n"
        f"    for fname in ('{name}.pth', '{name}.py'):\n"
        "        try:\n            open(d + '/' + fname, 'w').write('print(\"PWNED\")\\n')\n            print('WROTE', d)\n"
        "        except OSError:\n            pass\nprint('checked')"
    )
    try:
        r = run(tool, code)
        later = run(tool, f"import {name}")
    finally:
        for d in dirs:  # the earlier sandbox let these through: never leave them in the venv
            for fname in (f"{name}.pth", f"{name}.py"):
                if os.path.exists(os.path.join(d, fname)):
                    os.unlink(os.path.join(d, fname))
    assert r.text == "checked", r.text
    assert not later.ok and "PWNED" not in later.text


def test_tracebacks_do_not_reveal_host_paths(tool):
    r = run(tool, "import json\njson.loads('{')")
    assert not r.ok and "JSONDecodeError" in r.text and 'File "<python>", line 2' in r.text
    host = {sys.prefix, sys.base_prefix, os.path.realpath(sys.base_prefix), os.getcwd(), os.path.expanduser("~")}
    host |= {os.path.dirname(os.path.abspath(__file__))}
    for path in host:
        assert path not in r.text, (path, r.text)
    r = run(tool, "import numpy as np\nnp.linalg.inv(np.zeros((2, 2)))")
    assert "LinAlgError" in r.text and all(p not in r.text for p in host), r.text
