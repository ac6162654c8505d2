"""A training step with a tool that never returns completes: every call times out, the model reads the error.

The in-process sampler's batching and decode thread are the real ones (`TransformersBackend`), only the model's
sampling is scripted; the tool is a plain sync function (TRL's `tools=[func]`) that blocks until the test ends,
with more calls (36) than the loop's default executor has threads (min(32, cpus + 4)).
"""

from __future__ import annotations

import concurrent.futures
import json
import threading

import pytest
from datasets import Dataset

from appo_trl.config import APPOConfig
from appo_trl.rollout import Segment, TransformersBackend
from appo_trl.trainer.trainer import APPOTrainer
from tests.trainer.test_trainer import CPU

pytestmark = pytest.mark.timeout(300)

RELEASE = threading.Event()


def lookup(key: str) -> str:
    """Look a key up in a slow service (this one never answers until the test ends).

    Args:
        key: what to look up.
    """
    RELEASE.wait()
    return "released"


class ScriptedChatThreadBackend(TransformersBackend):
    """`TransformersBackend`'s queue and decode thread; the decode is scripted: one `lookup` call, then the answer."""

    def __init__(self, tok):
        self.tok, self.max_batch_size, self.eos_token_ids = tok, 8, {tok.eos_token_id}
        self.after = tok.convert_tokens_to_ids("</tool_response>")
        self._queues, self._workers, self._decoder_thread, self.num_batches = {}, {}, None, 0

    def _decode_batch(self, batch):
        self.num_batches += 1
        return [self._one(r.prompt_ids, r.params) for r in batch]

    def _one(self, prompt_ids, params):
        enc = lambda s: self.tok.encode(s, add_special_tokens=False)  # noqa: E731
        if self.after in prompt_ids:
            ids, reason, stop = enc(" <answer> 42 </answer>") + [self.tok.eos_token_id], "eos", None
        else:
            call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "six times seven"}}\n</tool_call>'
            ids, reason, stop = enc(call) + [self.tok.eos_token_id], "eos", None  # the turn ends, then the call runs
        ids = ids[: params.max_tokens]
        return Segment(ids, [-0.5] * len(ids), None, reason, stop)


def test_a_step_with_a_stuck_tool_completes(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path):
    RELEASE.clear()
    rows = 36
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"what is 6 times 7 ({i})"}] for i in range(9)]})
    args = APPOConfig(output_dir=str(tmp_path), **CPU, num_generations=4, per_device_train_batch_size=rows,
                      max_steps=1, max_completion_length=64, tool_format="chat", rollout_concurrency=64,
                      tool_config={"lookup": {"timeout": 0.5}})  # fmt: skip
    texts = []

    def reward(completions, **kw):
        texts.extend(json.dumps(c) for c in completions)
        return [float(i % 2) for i in range(len(completions))]

    trainer = APPOTrainer(model=tiny_chat_model_path, reward_funcs=[reward], args=args, train_dataset=data,
                          processing_class=tiny_chat_tokenizer, tools=[lookup])  # fmt: skip
    trainer.rollout_engine.backend = ScriptedChatThreadBackend(tiny_chat_tokenizer)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        future = pool.submit(trainer.train)
        try:
            future.result(timeout=150)
        except concurrent.futures.TimeoutError:
            pytest.fail("the training step did not complete in 150 s: stuck tool calls starved the sampler")
    finally:
        RELEASE.set()
        pool.shutdown(wait=False)
    assert trainer.state.global_step == 1 and len(texts) == rows
    # the model read the timeout as the tool's answer and went on (assistant, tool, assistant)
    assert all('"content": "Error: Tool(lookup) timed out after 0.5 seconds."' in t for t in texts)
    assert all(t.count('"role": "assistant"') == 2 for t in texts)
    logged = {k: v for e in trainer.state.log_history for k, v in e.items()}
    assert logged["tools/timeouts"] == rows
