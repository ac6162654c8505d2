"""Inference for evaluation through the training rollout engine (`appo_trl.rollout.RolloutEngine`).

`RolloutGenerator` turns a `Request` into a `Generation`: the chat prompt is templated and tokenised once,
the engine runs the same multi-turn tool loop as in training (stop strings `</python>` / `</search>`
forwarded to the sampler, the training result template, one call limit over all tools, the same tools
built by `appo_trl.tools.build_tools`), and the trajectory is decoded back to text. Each request is one
`engine.rollout([prompt], n=1, seed=request.seed)`, so every sample's seed depends only on its key; many
requests run concurrently on one event loop. One engine is built per (tool set, call limit), lazily.

`tool_format: chat` evaluates in the model's own function-calling format instead: the prompt is rendered with
the tools' JSON schemas (`apply_chat_template(tools=...)`), the engine stops on the template's tool-call close
marker and splices results as `tool` turns (`appo_trl.rollout.chat_format`), exactly as training does.

Backends (`backend:` in the eval config; `BACKENDS` registry): `vllm`, a running `vllm serve` /
`trl vllm-serve` at `base_url` (the trained checkpoint), and `transformers`, the model loaded in-process
(CPU smoke runs, small models). Anything implementing the rollout `Backend` protocol can be passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from appo_trl.evaluation.config import EvalConfig
from appo_trl.evaluation.runner import Generation, Request


def _vllm_backend(config: EvalConfig, tokenizer) -> Any:
    from appo_trl.vllm import VLLMServerBackend

    extra = {} if config.repetition_penalty is None else {"repetition_penalty": config.repetition_penalty}
    return VLLMServerBackend(config.base_url, max_concurrency=config.concurrency, extra_body=extra)


def _transformers_backend(config: EvalConfig, tokenizer) -> Any:
    from transformers import AutoModelForCausalLM

    from appo_trl.rollout import TransformersBackend

    model = AutoModelForCausalLM.from_pretrained(config.model)
    model.eval()
    return TransformersBackend(model, tokenizer)


# name -> fn(config, tokenizer) -> rollout Backend
BACKENDS: dict[str, Callable[[EvalConfig, Any], Any]] = {
    "vllm": _vllm_backend,
    "transformers": _transformers_backend,
}


class RolloutGenerator:
    """Async `Request -> Generation` on the rollout engine (pass it to `evaluate`).

    Args:
        config: the eval config (sampling, lengths, tool parameters).
        backend: a rollout `Backend` (vLLM server, in-process transformers, or a scripted one in tests).
        tokenizer: the evaluated model's tokenizer (its chat template builds the prompts).
    """

    def __init__(self, config: EvalConfig, backend: Any, tokenizer: Any):
        self.config = config
        self.backend = backend
        self.tokenizer = tokenizer
        self._engines: dict[tuple, Any] = {}
        self._tools: list[Any] = []
        self._chat = None
        if config.tool_format == "chat":
            from appo_trl.rollout.chat_format import ChatToolFormat

            self._chat = ChatToolFormat(tokenizer)

    def encode_prompt(self, messages: list[dict[str, str]], schemas: list[dict] | None = None) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, tools=schemas or None
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def engine(self, tools: list[str], call_limit: int) -> Any:
        key = (tuple(tools), call_limit)
        if key not in self._engines:
            from appo_trl.rollout import RolloutConfig, RolloutEngine
            from appo_trl.tools import build_tools

            built = build_tools(list(tools), self.config.tool_params(list(tools)), tool_format=self.config.tool_format)
            self._tools += list(built.values())
            rollout_config = RolloutConfig(
                max_completion_length=self.config.max_completion_length,
                max_model_len=self.config.max_model_len,
                call_limit=call_limit,
                temperature=self.config.temperature,
                top_p=self.config.top_p,
                top_k=self.config.top_k,
                tool_tags=list(built) if self._chat is None else ["python", "search"],
                concurrency=self.config.concurrency,
            )
            self._engines[key] = RolloutEngine(self.backend, self.tokenizer, rollout_config, built, chat=self._chat)
        return self._engines[key]

    async def __call__(self, request: Request) -> Generation:
        engine = self.engine(request.tools, request.call_limit)
        schemas = [t.schema for t in engine.executor.tools.values()] if self._chat is not None else None
        groups = await engine.rollout([self.encode_prompt(request.messages, schemas)], 1, seed=request.seed)
        traj = groups[0][0]
        calls = [
            {"tag": c.tag, "ok": c.ok, "query": c.query, "latency_s": round(c.latency_s, 4)} for c in traj.tool_calls
        ]
        return Generation(
            completion=self.tokenizer.decode(traj.completion_ids, skip_special_tokens=True),
            tool_calls=calls,
            finish_reason=traj.finish_reason,
            completion_tokens=int(sum(traj.loss_mask)),
            limit_hit=traj.finish_reason == "call_limit",
            meta={"num_calls": traj.num_calls, "total_tokens": len(traj.completion_ids)},
        )

    async def aclose(self) -> None:
        """Close tools and backend clients on the loop that used them; engines are rebuilt lazily."""
        tools, self._tools, self._engines = self._tools, [], {}
        for tool in tools:
            await tool.aclose()
        backend_close = getattr(self.backend, "aclose", None)
        if backend_close is not None:
            await backend_close()


def build_generator(config: EvalConfig) -> RolloutGenerator:
    """Tokenizer + backend from the config (`BACKENDS[config.backend]`) wrapped in a `RolloutGenerator`."""
    if not config.model:
        raise ValueError("Set `model` (checkpoint path or Hub id): its tokenizer builds the prompts.")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model)
    return RolloutGenerator(config, BACKENDS[config.backend](config, tokenizer), tokenizer)


__all__ = ["BACKENDS", "RolloutGenerator", "build_generator"]
