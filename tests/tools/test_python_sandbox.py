"""The python sandbox: ARPO semantics, and one adversarial property per test (each fails without its protection).

After every hostile snippet the fixture's `check_alive` runs `print(6*7)` through the same sandbox: a protection
that works but leaves the sandbox broken also fails.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import pytest

from appo_trl.tools.python_sandbox import PythonTool, PythonToolConfig

pytestmark = pytest.mark.timeout(60)

CONFIG = PythonToolConfig(timeout_s=3.0, memory_mb=1024, file_size_mb=1, max_processes=32, max_output_chars=500,
                          max_output_bytes=64 * 1024)  # fmt: skip


@pytest.fixture(scope="module")
def tool():
    os.environ["SEARCH_API_KEY"] = "sk-parent-secret-123"  # set before the zygote starts
    t = PythonTool(CONFIG)
    t.start()
    yield t
    asyncio.run(t.aclose())
    os.environ.pop("SEARCH_API_KEY", None)


def run(tool, code):
    result = asyncio.run(tool.call(code))
    after = asyncio.run(tool.call("print(6*7)"))
    assert after.ok and after.text == "42", f"sandbox broken after {code!r}: {after}"
    return result


# ---- ARPO semantics ---------------------------------------------------------------------------------
def test_stdout_and_bare_final_expression(tool):
    assert run(tool, "print(1+1)").text == "2"
    assert run(tool, "x = 20\nx * 2 + 2").text == "42"
    assert run(tool, "import numpy as np\nnp.arange(4).sum()").text == "6"


def test_error_returns_trimmed_traceback(tool):
    r = run(tool, "def f():\n    return 1/0\nf()")
    assert not r.ok and r.error == "exit_code=1"
    assert r.text.startswith("Traceback") and r.text.endswith("ZeroDivisionError: division by zero")
    assert "_zygote" not in r.text  # the sandbox's own frames are trimmed
    assert 'File "<python>", line 2, in f' in r.text


def test_syntax_error(tool):
    r = run(tool, "def (:")
    assert not r.ok and "SyntaxError" in r.text


def test_silent_code_runs_once_and_is_not_an_error(tool):
    # the host filesystem is read-only to the code: count executions on stderr (one "ran" per execution)
    r = run(tool, "import sys\nsys.stderr.write('ran')\n_ = 1")
    assert r.ok and r.text == CONFIG.empty_output_text
    assert r.meta["stderr_chars"] == len("ran")  # executed exactly once (ARPO re-ran silent code)


def test_fresh_process_per_call(tool):
    run(tool, "import math\nmath.SECRET_STATE = 1\nx_global = 5")
    r = run(tool, "import math\nprint(hasattr(math, 'SECRET_STATE'), 'x_global' in globals())")
    assert r.text == "False False"
    a, b = run(tool, "import random; random.random()").text, run(tool, "import random; random.random()").text
    assert a != b  # children do not share the zygote's random state


# ---- limits -------------------------------------------------------------------------------------------
def test_infinite_loop_is_killed(tool):
    r = run(tool, "while True:\n    pass")
    assert not r.ok and r.error in ("timeout", "signal=SIGXCPU")


def test_sigterm_ignoring_sleeper_is_killed_at_the_deadline(tool):
    r = run(
        tool,
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('started', flush=True)\ntime.sleep(60)",
    )
    assert r.error == "timeout" and r.text.startswith("started")


def test_memory_bomb(tool):
    # 3 GiB: allowed (and slowly zero-filled until the deadline) without the address-space limit
    r = run(tool, "blocks = [bytearray(2**30) for _ in range(3)]\nprint('allocated')")
    assert not r.ok and "MemoryError" in r.text


def test_huge_stdout_is_truncated(tool):
    r = run(tool, "import sys\nfor _ in range(200):\n    sys.stdout.write('x' * 100_000)\nprint('END')")
    assert r.ok and r.truncated and len(r.text) <= CONFIG.max_output_chars
    assert r.text.startswith("xxxx")


def test_large_file_write_is_refused(tool):
    r = run(tool, "with open('big.bin', 'wb') as f:\n    f.write(b'0' * (5 * 2**20))")
    assert not r.ok and "File too large" in r.text


def test_fork_bomb_is_contained(tool):
    code = (
        "import os, time\nn = 0\n"
        "try:\n    for _ in range(300):\n        if os.fork() == 0:\n            time.sleep(30)\n            os._exit(0)\n        n += 1\n"
        "except OSError as e:\n    print('fork refused after', n)\nelse:\n    print('forked', n)"
    )
    r = run(tool, code)
    # either the kernel refused the fork (RLIMIT_NPROC) or the watchdog killed the call: never 300 sleepers
    assert "forked 300" not in r.text
    assert (r.ok and "fork refused" in r.text) or r.error == "process_limit", r
    assert _sandbox_processes(tool) == []


def test_deep_recursion(tool):
    r = run(tool, "def f(n):\n    return f(n + 1)\nf(0)")
    assert not r.ok and "RecursionError" in r.text
    r = run(tool, "import sys\nsys.setrecursionlimit(10**7)\ndef f(n):\n    return f(n + 1)\nf(0)")
    assert not r.ok  # a C-stack overflow kills the child only


def test_binary_garbage_output(tool):
    r = run(tool, "import sys, os\nsys.stdout.buffer.write(bytes(range(256)) * 40 + os.urandom(4096))")
    assert r.ok and "\x00" not in r.text and "\x07" not in r.text
    r.text.encode("utf-8")  # valid text


# ---- isolation ------------------------------------------------------------------------------------------
def test_parent_secret_is_not_visible(tool):
    # look everywhere the child can: its environment, and every /proc/*/environ it can read (the zygote's
    # included); print only the places that leak, so that output truncation cannot hide a leak
    code = (
        "import os, glob\nsecret = b'sk-parent-secret-123'\n"
        "if secret.decode() in repr(dict(os.environ)):\n    print('LEAK os.environ')\n"
        f"for p in glob.glob('/proc/*/environ') + ['/proc/{os.getpid()}/environ']:\n"
        "    try:\n        data = open(p, 'rb').read()\n    except OSError:\n        continue\n"
        "    if secret in data or b'SEARCH_API_KEY' in data:\n        print('LEAK', p)\n"
        "print('checked')"
    )
    r = run(tool, code)
    assert r.ok and r.text == "checked", r.text


def test_killing_the_parent_does_not_kill_the_sandbox(tool):
    zygote = tool.sandbox.zygote_pid
    run(tool, "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")
    assert tool.sandbox.zygote_pid == zygote  # no restart was needed: the zygote survived


def _sandbox_processes(tool):
    """Processes visible inside the sandbox other than the zygote and the asking child."""
    r = asyncio.run(tool.call(
        "import os\nme = os.getpid()\n"
        "print([p for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, me)])"
    ))  # fmt: skip
    return eval(r.text)  # noqa: S307 - a list literal printed by our own snippet


def test_setsid_double_fork_does_not_outlive_the_call(tool):
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n    os._exit(0)\nprint('parent done')"
    r = run(tool, code)
    assert r.ok and r.text == "parent done"
    assert _sandbox_processes(tool) == []


def test_network_is_blocked(tool):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        r = run(tool, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('CONNECTED')")
    finally:
        server.close()
    assert "CONNECTED" not in r.text and ("Network is unreachable" in r.text or "timed out" in r.text), r.text


def test_concurrent_calls(tool):
    async def many():
        return await asyncio.gather(*(tool.call(f"print({i} * 2)") for i in range(40)))

    results = asyncio.run(many())
    assert [r.text for r in results] == [str(i * 2) for i in range(40)]


def test_dead_zygote_is_restarted():
    t = PythonTool(PythonToolConfig(timeout_s=3, preload=("math",)))
    t.start()
    first = t.sandbox.zygote_pid
    os.kill(first, signal.SIGKILL)
    while t.sandbox._z is not None:  # the reader notices the death
        time.sleep(0.01)
    r = asyncio.run(t.call("print('back')"))
    assert r.text == "back" and t.sandbox.zygote_pid != first
    asyncio.run(t.aclose())


def test_bad_config_fails_early():
    with pytest.raises(ValueError, match="timeout_s"):
        PythonToolConfig(timeout_s=0)
    with pytest.raises(ValueError, match="isolation"):
        PythonToolConfig(isolation="docker")
    with pytest.raises(ValueError, match="max_output_bytes"):
        PythonToolConfig(max_output_bytes=0)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in os.listdir(f"/proc/{p}/task") if os.path.exists(f"/proc/{p}/task") else []:
            try:
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    kids = [int(k) for k in fh.read().split()]
            except OSError:
                kids = []
            out += kids
            todo += kids
    return out


def test_close_leaves_no_process_behind():
    """Host-side view: closing the sandbox mid-call removes the zygote and every process of the call."""
    t = PythonTool(PythonToolConfig(timeout_s=30, preload=("math",)))
    t.start()
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('x', flush=True)\ntime.sleep(60)"

    async def go():
        task = asyncio.ensure_future(t.call(code))
        while len(_descendants(t.sandbox.zygote_pid)) < 3:  # zygote, the call, its setsid child
            await asyncio.sleep(0.05)
        pids = [t.sandbox.zygote_pid, *_descendants(t.sandbox.zygote_pid)]
        await t.aclose()
        return pids, await task

    pids, result = asyncio.run(go())
    assert not result.ok
    assert [p for p in pids if os.path.exists(f"/proc/{p}")] == []
