"""Per-call limits and residue: threads count, a bomb in one call never kills another, memory is limited for a
call as a whole, and nothing (files, shared memory, network or mount changes) outlives the call."""

from __future__ import annotations

import asyncio
import secrets
import subprocess

import pytest

from appo_trl.tools.python_sandbox import PythonTool, PythonToolConfig
from tests.tools.conftest import assert_alive, running_python_tool

pytestmark = pytest.mark.timeout(120)

CONFIG = PythonToolConfig(timeout_s=8.0, memory_mb=1024, max_processes=32, max_output_bytes=64 * 1024,
                          preload=("math",))  # fmt: skip


@pytest.fixture(scope="module")
def tool():
    with running_python_tool(CONFIG) as t:
        yield t


def run(tool, code):
    result = asyncio.run(tool.call(code))
    assert_alive(tool, code)
    return result


def test_threads_count_against_the_process_limit(tool):
    code = (
        "import threading\nthreading.stack_size(64 * 1024)\nstop = threading.Event()\nn = 0\n"  # small stacks: not RLIMIT_AS
        "try:\n    for _ in range(3000):\n        threading.Thread(target=stop.wait, daemon=True).start()\n        n += 1\n"
        "except RuntimeError:\n    pass\nstop.set()\nprint(n)"
    )
    r = run(tool, code)
    assert r.ok and int(r.text) < CONFIG.max_processes, r.text


def test_setsid_fork_bomb_does_not_kill_innocent_concurrent_calls(tool):
    innocent = "import time\ntime.sleep(1.5)\nprint('innocent')"
    bomb = (
        "import os, time\nn = 0\n"
        "for _ in range(200):\n    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        os.setsid()\n        time.sleep(30)\n        os._exit(0)\n    n += 1\n"
        "print('forked', n)"
    )

    async def go():
        return await asyncio.gather(*(tool.call(c) for c in [innocent] * 4 + [bomb] + [innocent] * 4))

    results = asyncio.run(go())
    texts = [r.text for r in results]
    assert texts[:4] == ["innocent"] * 4 and texts[5:] == ["innocent"] * 4, texts
    assert results[4].ok and int(results[4].text.split()[1]) < CONFIG.max_processes, results[4].text
    assert (
        asyncio.run(
            tool.call(
                "import os\nprint(sorted(os.listdir('/proc'))[:0], [p for p in os.listdir('/proc') if p.isdigit()])"
            )
        ).text
        == "[] ['1']"
    )


def test_memory_limit_counts_every_process_of_a_call():
    t = PythonTool(PythonToolConfig(timeout_s=20, memory_mb=300, max_processes=16, preload=("math",)))
    t.start()
    if not getattr(t.sandbox, "info", {"cgroups": 1}).get("cgroups"):
        asyncio.run(t.aclose())
        pytest.skip("no writable cgroups here: memory is limited per process only (documented)")
    code = (
        "import os, time\nkids = []\n"
        "for _ in range(2):\n    pid = os.fork()\n    if pid == 0:\n"
        "        block = b'x' * (150 * 2**20)\n        time.sleep(3)\n        os._exit(0)\n    kids.append(pid)\n"
        "block = b'x' * (150 * 2**20)\ntime.sleep(1)\n"
        "ok = all(os.waitpid(k, 0)[1] == 0 for k in kids)\nprint('all allocated' if ok else 'a child died')"
    )
    try:
        r = asyncio.run(t.call(code))
        after = asyncio.run(t.call("print(1)"))
    finally:
        asyncio.run(t.aclose())
    assert "all allocated" not in r.text, r  # 3 x 150 MB in one call must not pass a 300 MB limit
    assert after.text == "1"


def test_files_and_shared_memory_do_not_outlive_the_call(tool):
    name, key = f"appo-residue-{secrets.token_hex(6)}", 0x5A000000 + secrets.randbelow(1 << 20)
    write = (
        f"import ctypes\nfor d in ('.', '/tmp', '/dev/shm'):\n    open(d + '/{name}', 'w').write('x')\n"
        f"libc = ctypes.CDLL(None, use_errno=True)\nprint('shm', libc.shmget({key}, 4096, 0o1666))"
    )
    check = (
        f"import ctypes, os\nfor d in ('.', '/tmp', '/dev/shm'):\n    if os.path.exists(d + '/{name}'):\n"
        "        print('FOUND', d)\n"
        f"libc = ctypes.CDLL(None, use_errno=True)\nif libc.shmget({key}, 0, 0) != -1:\n    print('FOUND shm')\n"
        "print('checked')"
    )
    first = run(tool, write)
    assert first.ok and not first.text.endswith("-1"), first.text
    assert run(tool, check).text == "checked"
    found = subprocess.run(["find", "/tmp", "/dev/shm", "-name", name], capture_output=True, text=True).stdout
    assert found == ""
    assert f"{key:#010x}" not in subprocess.run(["ipcs", "-m"], capture_output=True, text=True).stdout


IFF_UP = 0x1
LO_FLAGS = (
    "import fcntl, socket, struct\ns = socket.socket()\n"
    "def flags():\n    return struct.unpack('16sH', fcntl.ioctl(s, 0x8913, struct.pack('16sH', b'lo', 0)))[1]\n"
)


def test_loopback_and_mount_changes_do_not_persist(tool):
    attack = LO_FLAGS + (
        "try:\n    fcntl.ioctl(s, 0x8914, struct.pack('16sH', b'lo', flags() | 1))\n    print('lo up')\n"
        "except OSError as e:\n    print('lo refused', e.errno)\n"
        "import ctypes\nlibc = ctypes.CDLL(None)\nprint([libc.umount2(p, 2) for p in (b'/proc', b'/tmp', b'/usr')])"
    )
    run(tool, attack)
    r = run(
        tool,
        LO_FLAGS + "import os\nprint(flags() & 1, os.path.exists('/proc/self/status'), os.path.isdir('/usr/lib'))",
    )
    assert r.text == "0 True True", r.text
