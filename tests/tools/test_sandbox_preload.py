"""The zygote's preload split: stdlib modules are imported by the zygote, which forks the workers of ordinary
calls; third-party ones (numpy, sympy) by a template process, which forks the workers of calls that name them.
Forking from the small zygote is what keeps `print(1+1)` fast (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from appo_trl.tools.python_sandbox import PythonTool, PythonToolConfig

pytestmark = pytest.mark.timeout(120)

HEAVY_LOADED = "import sys\nprint(sum(m in sys.modules for m in ('numpy', 'sympy')))"
# the same check without naming a heavy module, so it runs on an ordinary (light) worker
LIGHT_LOADED = "import sys\nprint(sum(m in sys.modules for m in ('nu' + 'mpy', 'sy' + 'mpy')))"


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return [int(k) for k in fh.read().split()]


def test_calls_naming_a_heavy_module_find_it_imported_and_others_fork_from_a_small_zygote():
    t = PythonTool(PythonToolConfig(timeout_s=30))
    t.start()

    async def go():
        return [await t.call(code) for code in (HEAVY_LOADED, LIGHT_LOADED, "import math\nprint(math.factorial(5))",
                                                 "import numpy as np\nprint(int(np.arange(10).sum()))")]  # fmt: skip

    try:
        heavy, light, math_call, numpy_call = asyncio.run(go())
    finally:
        asyncio.run(t.aclose())
    assert heavy.text == "2"  # preloaded where named
    assert light.text == "0"  # the zygote that forks ordinary calls holds neither
    assert math_call.text == "120" and numpy_call.text == "45"


def test_a_dead_template_leaves_heavy_calls_working():
    t = PythonTool(PythonToolConfig(timeout_s=30))
    t.start()
    try:
        # the zygote's first child is the template (the workers come later: start() makes one for its probe call)
        template = min(
            _children(t.sandbox.zygote_pid), key=lambda pid: int(open(f"/proc/{pid}/stat").read().split()[21])
        )
        os.kill(template, signal.SIGKILL)
        while os.path.exists(f"/proc/{template}") and open(f"/proc/{template}/stat").read().split()[2] != "Z":
            time.sleep(0.01)
        r = asyncio.run(t.call("import numpy as np\nprint(int(np.arange(10).sum()))"))
        assert r.ok and r.text == "45", r  # imported by the call itself, on an ordinary worker
        assert asyncio.run(t.call("print(6*7)")).text == "42"
    finally:
        asyncio.run(t.aclose())
