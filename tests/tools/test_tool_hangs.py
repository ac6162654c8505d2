"""A synchronous tool that never returns: sampling goes on, calls time out with a warning, the process exits.

The in-process sampler (`TransformersBackend`) decodes in a thread. When sync tools ran in the event loop's
default executor (`asyncio.to_thread`), enough stuck calls filled that pool and no decode could start again:
the step never completed and nothing was logged. Here the tools have their own daemon-thread pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from appo_trl.rollout import RolloutConfig, RolloutEngine, TransformersBackend
from appo_trl.tools import ToolExecutor, build_tools
from appo_trl.tools.callables import FunctionTool
from appo_trl.tools.pool import ToolThreadPool

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.fake_vllm import ScriptedPolicy  # noqa: E402

pytestmark = pytest.mark.timeout(120)

RELEASE = threading.Event()  # set at the end of each test, so the stuck threads of this process finish


@pytest.fixture(autouse=True)
def _release_stuck_calls():
    RELEASE.clear()
    yield
    RELEASE.set()


def python(code: str) -> str:
    """Run code (this one never returns until the test releases it).

    Args:
        code: the program.
    """
    RELEASE.wait()
    return "released"


class ScriptedThreadBackend(TransformersBackend):
    """The in-process backend's batching and decode thread, with a scripted policy instead of the model."""

    def __init__(self, tokenizer, script):
        self.policy = ScriptedPolicy(tokenizer, script)
        self.tokenizer = tokenizer
        self.max_batch_size = 4
        self.eos_token_ids = {tokenizer.eos_token_id}
        self._queues, self._workers, self._decoder_thread, self.num_batches = {}, {}, None, 0

    def _decode_batch(self, batch):
        self.num_batches += 1
        return [asyncio.run(self.policy.generate(r.prompt_ids, r.params)) for r in batch]


def call_then_answer(tok):
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    rclose = tok.convert_tokens_to_ids("</result>")
    call = enc('<python>{"code": "1"}</python>')
    answer = enc("<answer>5</answer>") + [tok.eos_token_id]
    return lambda ctx, rng: answer if rclose in ctx else call


def test_stuck_sync_tool_with_more_calls_than_threads_does_not_stop_sampling(tiny_tokenizer, caplog):
    """40 stuck calls (more than the default executor's min(32, cpus + 4) threads and the tool pool's 2):
    every trajectory ends with a timed-out result and its answer, and a warning names the tool and the call."""
    tools = build_tools([python], {"python": {"timeout": 0.5}}, tool_format="chat")
    assert tools["python"].call_timeout_s == 0.5
    executor = ToolExecutor(tools, max_workers=64, tool_threads=2)
    backend = ScriptedThreadBackend(tiny_tokenizer, call_then_answer(tiny_tokenizer))
    engine = RolloutEngine(backend, tiny_tokenizer, RolloutConfig(max_completion_length=64, max_model_len=256),
                           executor)  # fmt: skip
    prompt = tiny_tokenizer("What is 2 plus 3?", add_special_tokens=False)["input_ids"]
    n = 40
    start = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="appo_trl.tools.executor"):
            future = asyncio.run_coroutine_threadsafe(engine.rollout([prompt], n, seed=0), engine._ensure_loop())
            try:
                [trajs] = future.result(timeout=60)
            except concurrent.futures.TimeoutError:
                pytest.fail("the rollout did not finish in 60 s: stuck tool calls starved the sampler")
    finally:
        RELEASE.set()
        engine.close()
    assert len(trajs) == n and all(t.finish_reason == "eos" for t in trajs)
    for t in trajs:
        [call] = t.tool_calls
        assert not call.ok and "timed out after 0.5 seconds" in call.result
    assert time.monotonic() - start < 60
    warnings = [r.getMessage() for r in caplog.records if "timed out" in r.getMessage()]
    assert len(warnings) == n
    assert "tool 'python' timed out after 0.5s and was abandoned, call: '{\"code\": \"1\"}'" in warnings[0]
    m = executor.metrics()
    assert m["tools/python/timeouts"] == n and m["tools/timeouts"] == n


def test_abandoned_threads_are_replaced_up_to_the_cap():
    pool = ToolThreadPool(max_workers=2, max_stuck=2)
    release = threading.Event()
    try:
        stuck = [pool.submit(release.wait) for _ in range(2)]
        time.sleep(0.2)
        assert all(f.running() for f in stuck)
        assert [pool.abandon(f) for f in stuck] == [True, True]
        assert pool.stuck == 2 and not pool.exhausted
        assert pool.submit(lambda: 7).result(timeout=5) == 7  # replacement threads serve new calls
        more = [pool.submit(release.wait) for _ in range(2)]
        time.sleep(0.2)
        [pool.abandon(f) for f in more]
        assert pool.stuck == 4 and pool.exhausted  # 4 threads stuck, no spare left
        late = pool.submit(lambda: 8)
        with pytest.raises(concurrent.futures.TimeoutError):
            late.result(timeout=0.3)
        release.set()  # the stuck calls return: their threads serve the queue again
        assert late.result(timeout=5) == 8
        time.sleep(0.2)
        assert pool.stuck == 0 and not pool.exhausted
    finally:
        release.set()
        pool.shutdown()


def test_a_process_with_a_stuck_tool_exits_promptly(tmp_path):
    script = textwrap.dedent(
        """
        import asyncio, threading, time
        from appo_trl.tools import ToolExecutor
        from appo_trl.tools.callables import FunctionTool

        def hang(x: str) -> str:
            '''Never returns.

            Args:
                x: ignored.
            '''
            threading.Event().wait()

        async def main():
            ex = ToolExecutor({"hang": FunctionTool(hang, call_timeout_s=0.3)})
            result = await ex.execute("hang", '{"x": "1"}')
            print(result.error, flush=True)
            await ex.aclose()

        asyncio.run(main())
        """
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit within 30 s: interpreter exit waited on the stuck tool thread")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "timeout"
    assert time.monotonic() - start < 30


def test_tool_config_timeout_is_checked():
    with pytest.raises(ValueError, match=r"tool_config\['python'\].timeout must be a number of seconds > 0"):
        build_tools([python], {"python": {"timeout": 0}}, tool_format="chat")
    with pytest.raises(ValueError, match="unknown parameter for function tool 'python': 'retries'"):
        build_tools([python], {"python": {"retries": 2}}, tool_format="chat")
    with pytest.raises(ValueError, match="unknown tool in tool_config 'pyton'"):
        build_tools([python], {"pyton": {"timeout": 1}}, tool_format="chat")
    assert FunctionTool(python).call_timeout_s is None
