"""`SlowSteps`: a vLLM logits processor the test servers load (`--logits-processors slow_steps:SlowSteps`) that
holds each decode step for `vllm_xargs={"appo_step_s": s}` seconds while a request that asks is in the batch.

The in-flight update tests pause the server while a long request decodes. The tiny model's engine decoded 1,500
tokens before a loaded API server had streamed 40 of them, so the pause came after the end (CI of d12ef0f: abort
mode, three attempts). A step of at least `s` seconds bounds the engine's speed instead of the machine's load;
the logits are returned unchanged, so the sampled tokens and their logprobs are those of a plain step."""

from __future__ import annotations

import time

from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor

KEY = "appo_step_s"


class SlowSteps(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        self.step_s: dict[int, float] = {}  # batch index -> seconds its request asked each step to take

    def is_argmax_invariant(self) -> bool:
        return False  # applied to greedy requests too (it changes no logit)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.step_s, batch_update, lambda params, _p, _o: (params.extra_args or {}).get(KEY))

    def apply(self, logits):
        if self.step_s:
            time.sleep(max(self.step_s.values()))
        return logits
