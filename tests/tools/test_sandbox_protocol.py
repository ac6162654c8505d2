"""The sandbox's control plane and the trainer's survival: each test is an attack that once worked.

A call could write forged replies on the zygote's pipes, rewrite the zygote's memory, kill it with SIGINT, send
it garbage, freeze it (blocking the trainer's event loop), or make the trainer spend seconds decoding its
output. Also: fail closed when isolation cannot be had, and `isolation: none` only as a loud opt-in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile

import pytest

from appo_trl.tools import isolation as iso
from appo_trl.tools import python_sandbox as ps
from appo_trl.tools.python_sandbox import PythonTool, PythonToolConfig
from tests.tools.conftest import running_python_tool

pytestmark = pytest.mark.timeout(120)

CONFIG = PythonToolConfig(timeout_s=5.0, memory_mb=1024, max_processes=32, max_output_bytes=64 * 1024,
                          preload=("math",))  # fmt: skip


@pytest.fixture
def tool():
    with running_python_tool(CONFIG) as t:
        yield t


async def _gather(tool, codes):
    return await asyncio.gather(*(tool.call(c) for c in codes))


def test_forged_replies_on_the_zygotes_pipes_cannot_change_other_calls(tool):
    honest = [f"import time\ntime.sleep(0.3)\nprint('honest-{i}')" for i in range(6)]
    attack = (
        "import os, json, glob\nforged = 0\n"
        "for path in glob.glob('/proc/*/fd/*'):\n"
        "    if path.startswith((f'/proc/{os.getpid()}/', '/proc/self/', '/proc/thread-self/')):\n        continue\n"
        "    try:\n        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)\n    except OSError:\n        continue\n"
        "    for i in range(1, 300):\n"
        "        reply = {'id': i, 'exit_code': 0, 'signal': None, 'timed_out': False, 'killed': None,\n"
        "                 'duration_s': 0.0, 'stdout': 'FORGED', 'stderr': '', 'stdout_truncated': False,\n"
        "                 'stderr_truncated': False}\n"
        "        try:\n            os.write(fd, (json.dumps(reply) + '\\n').encode())\n            forged += 1\n"
        "        except OSError:\n            break\n"
        "print('forged', forged)"
    )
    results = asyncio.run(_gather(tool, [*honest, attack]))
    assert [r.text for r in results[:-1]] == [f"honest-{i}" for i in range(6)]
    assert results[-1].text == "forged 0", results[-1].text


def test_writing_pid_1_memory_does_not_persist_into_later_calls(tool):
    attack = (
        "import math, struct\n"
        "for pid in (1, 2):\n"
        "    try:\n        with open(f'/proc/{pid}/mem', 'r+b') as mem:\n"
        "            mem.seek(id(math.pi) + 16)\n            mem.write(struct.pack('d', 3.0))\n"
        "    except OSError:\n        pass\n"
        "print('done')"
    )
    asyncio.run(tool.call(attack))
    r = asyncio.run(tool.call("import math\nprint(math.pi)"))
    assert r.text == "3.141592653589793"


def test_sigint_to_the_zygote_does_nothing(tool):
    zygote = tool.sandbox.zygote_pid
    inside = "import os, signal\nfor pid in (1, 2, os.getppid()):\n    try:\n        os.kill(pid, signal.SIGINT)\n    except OSError:\n        pass\nprint('sent')"

    async def go():
        innocent = asyncio.ensure_future(tool.call("import time\ntime.sleep(0.5)\nprint('innocent')"))
        await asyncio.sleep(0.1)
        await tool.call(inside)
        os.kill(zygote, signal.SIGINT)  # from the host too (e.g. Ctrl-C reaching it)
        return await innocent

    assert asyncio.run(go()).text == "innocent"
    assert tool.sandbox.zygote_pid == zygote
    assert asyncio.run(tool.call("print(1)")).text == "1"


def test_partial_and_garbage_request_lines_do_not_break_the_zygote(tool):
    zygote, z = tool.sandbox.zygote_pid, tool.sandbox._z

    async def go():
        innocent = asyncio.ensure_future(tool.call("import time\ntime.sleep(0.5)\nprint('innocent')"))
        await asyncio.sleep(0.1)
        for junk in (b'{"id": "', b"garbage\n", b"[1, 2]\n", b'{"id": 5}\n', b"\xff\xfe\n",
                     b'{"id": "%s", "code": 5, "timeout_s": 1}\n' % secrets.token_hex(16).encode(),
                     b'{"id": "%s", "code": "print(1)", "timeout_s": -1}\n' % secrets.token_hex(16).encode(),
                     b"x" * (9 << 20) + b"\n"):  # fmt: skip
            z.queue.put(junk)
        return await innocent

    assert asyncio.run(go()).text == "innocent"
    assert asyncio.run(tool.call("print(2)")).text == "2"
    assert tool.sandbox.zygote_pid == zygote


FAKE_ZYGOTE = r"""
import json, os, sys, time
out = os.fdopen(1, "wb", buffering=0)
out.write(b'{"ready": true}\n')
ok = {"exit_code": 0, "signal": None, "timed_out": False, "killed": None, "duration_s": 0.0, "stderr": "",
      "stdout_truncated": False, "stderr_truncated": False, "setup_failed": False}
for n, line in enumerate(sys.stdin):
    req = json.loads(line)
    if n == 0:  # the start-up probe
        out.write((json.dumps(dict(ok, id=req["id"], stdout="ok\n")) + "\n").encode())
    elif n == 1:  # garbage, a non-object, an unknown id, then this call's reply without its keys
        out.write(b"garbage\n[1, 2]\n\xff\xfe\n" + json.dumps(dict(ok, id="0" * 32, stdout="x")).encode() + b"\n")
        out.write(b'{"id": "%s"}\n' % req["id"].encode())
    else:  # a valid reply, cut in two writes
        data = (json.dumps(dict(ok, id=req["id"], stdout="fine")) + "\n").encode()
        out.write(data[:7])
        time.sleep(0.2)
        out.write(data[7:])
"""


def test_malformed_replies_fail_only_the_call_they_name(monkeypatch):
    def fake(zcfg, *args, **kwargs):
        return iso.Launch([sys.executable, "-c", FAKE_ZYGOTE], (), [], False, [])

    monkeypatch.setattr(iso, "build_launch", fake)
    t = PythonTool(CONFIG)
    t.start()
    try:
        first = asyncio.run(t.call("print(1)"))
        second = asyncio.run(t.call("print(2)"))
        z = t.sandbox._z
    finally:
        asyncio.run(t.aclose())
    assert not first.ok and first.error == "sandbox_error"
    assert second.ok and second.text == "fine"
    assert z.bad_messages == 4


def test_stalled_zygote_is_replaced_without_blocking_the_event_loop(tool, monkeypatch):
    monkeypatch.setattr(ps, "REPLY_GRACE_S", 1.0)
    zygote = tool.sandbox.zygote_pid
    os.kill(zygote, signal.SIGSTOP)  # a frozen zygote (the earlier attack used ptrace)
    big = "x = 1\n" + "#" * 200_000 + "\nprint(x)"  # 30 of these fill any pipe: a synchronous write would block

    async def go():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        tick = asyncio.ensure_future(ticker())
        results = await asyncio.gather(
            *(
                tool.call(
                    big,
                )
                for _ in range(30)
            )
        )
        tick.cancel()
        return results, ticks

    results, ticks = asyncio.run(go())
    assert {r.error for r in results} == {"sandbox_unresponsive"}
    assert ticks > 50  # the loop kept running while the zygote was frozen
    assert not os.path.exists(f"/proc/{zygote}") or open(f"/proc/{zygote}/stat").read().split()[2] == "Z"
    assert asyncio.run(tool.call("print('back')")).text == "back"
    assert tool.sandbox.zygote_pid != zygote


def test_dead_zygote_fails_calls_in_flight_and_leaves_no_files(tool):
    name = f"appo-residue-{secrets.token_hex(6)}"
    code = (
        f"for d in ('.', '/tmp', '/dev/shm'):\n    open(d + '/{name}', 'w').write('data')\n"
        "print('written', flush=True)\nimport time\ntime.sleep(30)"
    )

    async def go():
        task = asyncio.ensure_future(
            tool.call(
                code,
            )
        )
        await asyncio.sleep(1.0)
        os.kill(tool.sandbox.zygote_pid, signal.SIGKILL)
        return await asyncio.wait_for(task, 10)

    r = asyncio.run(go())
    assert not r.ok and r.error == "sandbox_died"
    found = subprocess.run(["find", "/tmp", "/dev/shm", tempfile.gettempdir(), "-name", name],
                           capture_output=True, text=True).stdout  # fmt: skip
    assert found == ""
    assert asyncio.run(tool.call("print('back')")).text == "back"


def test_huge_binary_output_costs_the_trainer_at_most_the_cap(tool):
    z = tool.sandbox._z
    before_bytes, before_reads = z.bytes_read, z.reads
    code = "import sys\nsys.stdout.buffer.write(b'\\xff' * 2**20)\nsys.stderr.buffer.write(b'\\x01' * 2**20)"
    r = asyncio.run(tool.call(code))
    got, reads = z.bytes_read - before_bytes, z.reads - before_reads
    cap = CONFIG.max_output_bytes
    assert r.ok and r.truncated
    assert got <= 4 * cap + 4096, got  # ~3 bytes per replaced byte of stdout; control bytes are dropped
    assert reads <= got // 4096 + 16, reads  # buffered: not one syscall per byte


def test_missing_bubblewrap_refuses_to_start(monkeypatch):
    real = iso.shutil.which
    monkeypatch.setattr(iso.shutil, "which", lambda name: None if name == "bwrap" else real(name))
    with pytest.raises(iso.IsolationError) as info:
        PythonTool(CONFIG)
    message = str(info.value)
    assert "\n" not in message and "bubblewrap" in message and "isolation: none" in message


def test_failed_jail_set_up_refuses_to_start(monkeypatch):
    real = iso.build_launch

    def broken(zcfg, *args, **kwargs):
        return real(dict(zcfg, limits=dict(zcfg["limits"], tmpfs_mb=-1)), *args, **kwargs)  # the tmpfs mount fails

    monkeypatch.setattr(iso, "build_launch", broken)
    t = PythonTool(CONFIG)
    with pytest.raises(iso.IsolationError, match="isolation could not be set up"):
        t.start()
    r = asyncio.run(t.call("print(1)"))  # a call never runs unisolated either
    assert not r.ok and r.error == "sandbox_down"
    asyncio.run(t.aclose())


def test_isolation_none_is_an_explicit_loud_opt_in(caplog):
    t = PythonTool(PythonToolConfig(isolation="none", preload=("math",)))
    with caplog.at_level(logging.WARNING):
        t.start()
    try:
        assert any("UNISOLATED" in rec.getMessage() for rec in caplog.records)
        assert asyncio.run(t.call("print(6*7)")).text == "42"
    finally:
        asyncio.run(t.aclose())


def test_preflight_reports_missing_isolation_as_one_line(monkeypatch):
    from types import SimpleNamespace

    from appo_trl.configs.preflight import PreflightError, check_tools

    real = iso.shutil.which
    monkeypatch.setattr(iso.shutil, "which", lambda name: None if name == "bwrap" else real(name))
    args = SimpleNamespace(tools=["python"], tool_config={"python": {"timeout_s": 5}}, tool_format=None)
    with pytest.raises(PreflightError, match="bubblewrap") as info:
        check_tools(args)
    assert "\n" not in str(info.value)
