"""`EvalConfig`: every knob of `appo eval`, as a dataclass that YAML files and command-line flags fill."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from appo_trl.evaluation.judge import JudgeConfig


@dataclasses.dataclass
class EvalConfig:
    """Configuration of one evaluation run (`appo eval --config eval/<name>.yaml [--key value ...]`).

    Args:
        benchmarks: registry names to evaluate (`all` for every benchmark of the registry).
        registry: benchmark registry YAML; None uses the one shipped with the package.
        data_root: folder the registry's relative paths start from (else `$APPO_EVAL_DATA_ROOT`).
        limit: evaluate only the first `limit` questions of each benchmark (smoke runs).
        output_dir: where `samples.jsonl`, `judgments.jsonl`, `report.json`, `report.md`, `report.png` go; a
            rerun resumes there only for the same model, settings and questions (`run.json`).
        overwrite_output_dir: start fresh in `output_dir` (removes its samples, judgments and reports) instead
            of refusing to resume another run's samples.
        model: checkpoint path or Hub id (tokenizer and chat template; the weights too for `transformers`).
        backend: `vllm` (a running `vllm serve` / `trl vllm-serve` at `base_url`) or `transformers` (in-process).
        base_url: URL of the vLLM server.
        num_samples: samples per question (n of pass@k).
        ks: k values for pass@k / avg@k (k <= num_samples); None means 1, 2, 4, ... and num_samples.
        seed: base seed; every (benchmark, question, sample) gets its own seed derived from it.
        temperature, top_p, top_k: sampling (top_k -1 disables it).
        repetition_penalty: forwarded to the vLLM server when set (ARPO's eval used 1.1).
        max_completion_length: completion tokens per sample, tool results included (the rollout budget).
        max_model_len: prompt + completion + tool results, tokens.
        call_limit: tool calls per sample across all tools (None: 3 for math, 6 otherwise).
        prompt: system prompt style overriding every benchmark's own (None keeps the registry's).
        tools: tool names overriding every benchmark's own (None keeps the registry's); with
            `tool_format: chat` also dotted import paths of Python functions (`my_tools.lookup`).
        tool_format: `tags` (ARPO's `<python>` / `<search>` tags, the training default for these benchmarks) or
            `chat` (the model's chat template: tool schemas in the prompt, `<tool_call>` JSON, `tool` messages).
        search_backend: search tool backend: `cache` replays a frozen cache (reproducible scores; a query
            missing from the cache gets a "not in cache" result), `local` a retriever server, `web` live search.
        search_cache: the search cache file (ARPO's `{query: text}` json or the project's SQLite cache).
        tool_config: per-tool parameters keyed by tool name, as in training recipes (mapping or JSON string);
            `search_backend` / `search_cache` fill `search.backend` / `search.cache_path` unless set here.
        concurrency: samples generated at once.
        judge_base_url, judge_model, judge_api_key_env, judge_max_retries, judge_timeout_s, judge_concurrency:
            the optional LLM judge (see `JudgeConfig`); no judge when `judge_base_url` is empty.
    """

    benchmarks: list[str] = dataclasses.field(default_factory=lambda: ["all"])
    registry: str | None = None
    data_root: str | None = None
    limit: int | None = None
    output_dir: str = "eval_results/run"
    overwrite_output_dir: bool = False
    model: str = ""
    backend: str = "vllm"
    base_url: str = "http://127.0.0.1:8000"
    num_samples: int = 1
    ks: list[int] | None = None
    seed: int = 0
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = -1
    repetition_penalty: float | None = None
    max_completion_length: int = 8192
    max_model_len: int = 32768
    call_limit: int | None = None
    prompt: str | None = None
    tools: list[str] | None = None
    tool_format: str = "tags"
    search_backend: str = "cache"
    search_cache: str | None = None
    tool_config: dict | str | None = None
    concurrency: int = 32
    judge_base_url: str = ""
    judge_model: str = ""
    judge_api_key_env: str = "OPENAI_API_KEY"
    judge_max_retries: int = 3
    judge_timeout_s: float = 60.0
    judge_concurrency: int = 16

    def __post_init__(self):
        if isinstance(self.benchmarks, str):
            self.benchmarks = [b.strip() for b in self.benchmarks.split(",") if b.strip()]
        if isinstance(self.tools, str):
            self.tools = [t.strip() for t in self.tools.split(",") if t.strip()]
        if isinstance(self.ks, (str, int)):
            self.ks = [int(k) for k in str(self.ks).split(",") if k.strip()]
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.ks and max(self.ks) > self.num_samples:
            raise ValueError(f"ks {self.ks} exceed num_samples={self.num_samples} (pass@k needs k <= n)")
        if self.tool_format not in ("tags", "chat"):
            raise ValueError(f"tool_format must be 'tags' or 'chat', got {self.tool_format!r}")
        if self.backend not in ("vllm", "transformers"):
            raise ValueError(f"backend must be 'vllm' or 'transformers', got {self.backend!r}")

    def tool_params(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """`build_tools` parameters for the tools in `names` (blocks for other tools are left out)."""
        raw = self.tool_config or {}
        if isinstance(raw, str):
            raw = json.loads(raw)
        params = {name: dict(raw.get(name) or {}) for name in names if name in raw or name == "search"}
        params = {k: v for k, v in params.items() if k in ("python", "search")}  # built-in tools take parameters
        if "search" in params:
            params["search"].setdefault("backend", self.search_backend)
            if self.search_cache:
                params["search"].setdefault("cache_path", self.search_cache)
            elif params["search"]["backend"] != "cache" and params["search"].get("cache", True):
                # one cache per run, never a file shared by every run
                params["search"].setdefault("cache_path", os.path.join(self.output_dir, "search_cache.sqlite"))
        return params

    @property
    def judge(self) -> JudgeConfig:
        return JudgeConfig(
            base_url=self.judge_base_url,
            model=self.judge_model,
            api_key_env=self.judge_api_key_env,
            max_retries=self.judge_max_retries,
            timeout_s=self.judge_timeout_s,
            concurrency=self.judge_concurrency,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
