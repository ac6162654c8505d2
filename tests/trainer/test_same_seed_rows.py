"""The same seed gives the same rows at any rollout concurrency: forks, refills and branches are keyed on each
trajectory's identity, never on which trajectory reached its tool call first.

The in-process sampler's queue, batching and decode thread are the real ones (`TransformersBackend`); only the
decode is scripted from each request's seed, with random sleeps so that requests finish in a different order in
every run.
"""

from __future__ import annotations

import random
import time

import pytest
from datasets import Dataset

from appo_trl.config import APPOConfig
from appo_trl.rollout import Segment, TransformersBackend
from appo_trl.trainer.trainer import APPOTrainer
from tests.trainer.test_trainer import CPU

pytestmark = pytest.mark.timeout(300)
JITTER = random.Random()  # unseeded on purpose: the timing differs between runs


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: what to look up.
    """
    time.sleep(JITTER.random() * 0.004)
    return f"value of {key}"


class SeededJitterBackend(TransformersBackend):
    """Scripted chat turns drawn from the request's seed: 0-2 more `lookup` calls, then an answer."""

    def __init__(self, tok):
        self.tok, self.max_batch_size, self.eos_token_ids = tok, 3, {tok.eos_token_id}
        self.after = tok.convert_tokens_to_ids("</tool_response>")
        self._queues, self._workers, self._decoder_thread, self.num_batches = {}, {}, None, 0

    def _decode_batch(self, batch):
        self.num_batches += 1
        time.sleep(JITTER.random() * 0.004)
        return [self._one(r.prompt_ids, r.params) for r in batch]

    def _one(self, prompt_ids, params):
        rng = random.Random(params.seed)
        enc = lambda s: self.tok.encode(s, add_special_tokens=False)  # noqa: E731
        calls = prompt_ids.count(self.after)
        if calls < 3 and rng.random() < 0.7:
            text = f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "k{rng.randrange(100)}"}}}}\n</tool_call>'
        else:
            text = f" <answer> {rng.randrange(10)} </answer>"
        ids = (enc(text) + [self.tok.eos_token_id])[: params.max_tokens]
        lps = [-rng.random() * 3 for _ in ids]
        tops = [{t: lp, t + 1: lp - rng.random()} for t, lp in zip(ids, lps)] if params.logprobs else None
        return Segment(ids, lps, tops, "eos" if ids[-1] == self.tok.eos_token_id else "length", None)


def _rows(strategy, tmp_path, tok, model_path):
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"look up item {i}"}] for i in range(8)]})
    args = APPOConfig(output_dir=str(tmp_path), **CPU, rollout_strategy=strategy, num_generations=4,
                      initial_rollouts=2, per_device_train_batch_size=16, max_steps=2, max_completion_length=96,
                      tool_format="chat", rollout_concurrency=8, branch_probability=0.5,
                      dataloader_num_workers=0)  # fmt: skip
    seen = []

    def reward(completions, completion_ids, **kw):
        seen.append([list(c) for c in completion_ids])
        return [float(len(c) % 3) for c in completion_ids]

    trainer = APPOTrainer(model=model_path, reward_funcs=[reward], args=args, train_dataset=data,
                          processing_class=tok, tools=[lookup])  # fmt: skip
    trainer.rollout_engine.backend = SeededJitterBackend(tok)
    trainer.train()
    return seen, trainer.rollout_engine


@pytest.mark.parametrize("strategy", ["arpo", "aepo", "appo"])
def test_same_seed_same_rows_at_concurrency_8(strategy, tmp_path, tiny_chat_tokenizer, tiny_chat_model_path):
    first, engine = _rows(strategy, tmp_path / "a", tiny_chat_tokenizer, tiny_chat_model_path)
    second, _ = _rows(strategy, tmp_path / "b", tiny_chat_tokenizer, tiny_chat_model_path)
    assert len(first) == len(second) == 2 and all(len(r) == 16 for r in first)
    assert len({tuple(r) for step in first for r in step}) > 8  # the rows do differ from each other
    assert first == second
