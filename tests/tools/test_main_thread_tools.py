"""Synchronous tools that use signals run on the main thread, as in TRL (issue 34, item 2).

TRL's `examples/scripts/grpo_agent.py` wraps its SQL tool in a `signal.alarm` timeout; off the main thread every
call failed with "signal only works in main thread". Here such a tool is found at construction and its calls run
on the main thread while it waits for the rollout; a plain tool keeps the thread pool.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

from appo_trl.rollout import RolloutConfig, RolloutEngine
from appo_trl.rollout.chat_format import ChatToolFormat
from appo_trl.tools.callables import FunctionTool
from appo_trl.tools.main_thread import uses_signals
from appo_trl.tools.registry import build_tools
from bench.fake_vllm import ScriptedPolicy


@contextmanager
def timeout(seconds):  # grpo_agent.py's, in the tool's own module as in the script (uses_signals reads the module)
    def timeout_handler(signum, frame):
        raise TimeoutError(f"Operation timed out after {seconds} seconds")

    signal.signal(signal.SIGALRM, timeout_handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)


def guarded(x: int) -> str:
    """Echo under an alarm, naming the thread.

    Args:
        x: a number.
    """
    with timeout(5):
        return f"{x} on {threading.current_thread().name}"


def plain(x: int) -> str:
    """Echo, naming the thread.

    Args:
        x: a number.
    """
    return f"{x} on {threading.current_thread().name}"


def test_signal_use_is_found_through_the_module_helpers():
    assert uses_signals(guarded) and uses_signals(timeout)
    assert not uses_signals(plain) and not uses_signals(print)
    assert FunctionTool(guarded).main_thread and not FunctionTool(plain).main_thread


def test_a_signal_tool_runs_on_the_main_thread_in_a_rollout(tiny_chat_tokenizer):
    tok = tiny_chat_tokenizer
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    calls = '<tool_call>\n{"name": "guarded", "arguments": {"x": 1}}\n</tool_call>'
    calls += '<tool_call>\n{"name": "plain", "arguments": {"x": 2}}\n</tool_call>'
    turns = [enc(calls) + [tok.eos_token_id], enc("done") + [tok.eos_token_id]]
    close = tok.convert_tokens_to_ids("</tool_response>")
    script = lambda ctx, rng: turns[min(ctx.count(close) // 2, 1)]  # noqa: E731
    engine = RolloutEngine(ScriptedPolicy(tok, script), tok, RolloutConfig(max_completion_length=300),
                           build_tools([guarded, plain], tool_format="chat"), chat=ChatToolFormat(tok))  # fmt: skip
    try:
        [[traj]] = engine.run(engine.rollout([enc("<|im_start|>assistant\n")], 1, seed=0))
    finally:
        engine.close()
    first, second = traj.tool_calls
    assert first.ok and first.result == "1 on MainThread"
    assert second.ok and second.result.startswith("2 on appo-tool")
