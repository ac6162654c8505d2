"""Benchmark registry and loaders for ARPO's evaluation files.

The registry (`benchmarks.yaml` next to this module, or any file of the same shape) maps a benchmark name to
a data source, a task type, a prompt style and metrics. Loaders read ARPO's `test.jsonl` files unchanged:
the question is the first of `question`, `Question`, `problem`; the answer is a string, a list of strings
or a number, always returned as a list of gold strings. Files are never copied: paths are relative to a
data root given in the config or by `$APPO_EVAL_DATA_ROOT`.

What this module does not do: tokenisation, chat templating or scoring (see `runner` and `metrics`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from functools import cache
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).parent
DEFAULT_REGISTRY = HERE / "benchmarks.yaml"
PROMPTS_FILE = HERE / "prompts.yaml"
DATA_ROOT_ENV = "APPO_EVAL_DATA_ROOT"
QUESTION_FIELDS = ("question", "Question", "problem")
ANSWER_FIELDS = ("answer", "Answer", "answers", "golden_answers")
BINARY_METRICS = ("em", "cover_em", "math_equal", "llm_judge")


@dataclasses.dataclass
class Benchmark:
    """One benchmark of the registry.

    Args:
        name: registry key, used in reports.
        task: `math`, `qa` or `deep_search`.
        path: data file in ARPO's format (relative to the data root unless absolute).
        hub: Hub dataset id used when `path` is empty.
        split: split of a Hub dataset.
        prompt: system prompt style name or literal text.
        metric: headline metric name (see `appo_trl.evaluation.metrics.METRICS`).
        pass_metric: binary metric behind pass@k.
        fallback: replaces `llm_judge` in `metric`/`pass_metric` when no judge is configured.
        tools: tool names the model may call (built with `appo_trl.tools.build_tools`).
        answer_format: `None`, or `gsm8k` (keep the text after `####`).
    """

    name: str
    task: str
    path: str | None = None
    hub: str | None = None
    split: str = "test"
    prompt: str = "code_search"
    metric: str = "f1"
    pass_metric: str = "cover_em"
    fallback: str | None = None
    tools: list[str] = dataclasses.field(default_factory=lambda: ["search", "python"])
    answer_format: str | None = None

    def resolved_metrics(self, judge: bool) -> tuple[str, str]:
        """(metric, pass_metric) with `llm_judge` replaced by the fallback when there is no judge."""
        if judge:
            return self.metric, self.pass_metric
        fallback = self.fallback or "cover_em"
        metric = fallback if self.metric == "llm_judge" else self.metric
        # pass@k needs a 0/1 score: a graded fallback (f1) becomes cover-EM for the pass metric.
        binary = fallback if fallback in BINARY_METRICS else "cover_em"
        return metric, binary if self.pass_metric == "llm_judge" else self.pass_metric


@dataclasses.dataclass
class Example:
    """One question: `index` is its row number in the source file."""

    index: int
    question: str
    answers: list[str]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


def load_registry(path: str | os.PathLike | None = None) -> dict[str, Benchmark]:
    """Read a registry YAML (`tasks`, `defaults`, `benchmarks`) into `Benchmark`s, task defaults applied."""
    with open(path or DEFAULT_REGISTRY, encoding="utf-8") as f:
        raw = yaml.safe_load(f) or {}
    tasks, defaults = raw.get("tasks", {}), raw.get("defaults", {})
    fields = {f.name for f in dataclasses.fields(Benchmark)}
    out = {}
    for name, entry in (raw.get("benchmarks") or {}).items():
        entry = dict(entry)
        task = entry.get("task")
        if task not in tasks:
            raise ValueError(f"Benchmark {name!r}: unknown task {task!r} (known: {sorted(tasks)}).")
        merged = {**defaults, **tasks[task], **entry, "name": str(name)}
        unknown = set(merged) - fields
        if unknown:
            raise ValueError(f"Benchmark {name!r}: unknown keys {sorted(unknown)} (known: {sorted(fields)}).")
        if not merged.get("path") and not merged.get("hub"):
            raise ValueError(f"Benchmark {name!r} needs a `path` or a `hub` id.")
        out[str(name)] = Benchmark(**merged)
    return out


@cache
def _prompts() -> dict[str, Any]:
    with open(PROMPTS_FILE, encoding="utf-8") as f:
        return yaml.safe_load(f)


def system_prompt(style: str | None) -> str | None:
    """Text of a prompt style: prompts.yaml, then `appo_trl.data.SYSTEM_PROMPTS`, else the literal text."""
    if style is None or style == "none":
        return None
    named = _prompts()["system_prompts"]
    if style in named:
        return named[style]
    from appo_trl.data import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS.get(style, style)


def judge_prompt() -> str:
    """ARPO's judge prompt template with `{question}`, `{labeled_answer}`, `{pred_answer}` fields."""
    return _prompts()["judge"]


def resolve_data_root(data_root: str | None) -> str | None:
    """The configured data root, else `$APPO_EVAL_DATA_ROOT`, else None."""
    return data_root or os.environ.get(DATA_ROOT_ENV) or None


def _golds(value: Any, answer_format: str | None) -> list[str]:
    values = value if isinstance(value, list) else [value]
    golds = []
    for v in values:
        text = str(v).strip()
        if answer_format == "gsm8k" and "####" in text:
            text = text.rsplit("####", 1)[1].strip().replace(",", "")
        golds.append(text)
    return [g for g in golds if g]


def parse_row(row: dict[str, Any], index: int, answer_format: str | None = None, source: str = "") -> Example:
    """One ARPO-format record as an `Example` (errors name the fields that exist)."""
    question = next((row[f] for f in QUESTION_FIELDS if row.get(f)), None)
    answer = next((row[f] for f in ANSWER_FIELDS if row.get(f) is not None), None)
    if question is None or answer is None:
        raise KeyError(
            f"{source} row {index}: needs one of {QUESTION_FIELDS} and one of {ANSWER_FIELDS}; found {sorted(row)}"
        )
    meta = {k: row[k] for k in ("id", "task_id", "Level", "idx") if k in row}
    return Example(index=index, question=str(question), answers=_golds(answer, answer_format), meta=meta)


def load_examples(bench: Benchmark, data_root: str | None = None, limit: int | None = None) -> list[Example]:
    """Load a benchmark's questions (local jsonl/json/parquet in ARPO's format, or a Hub dataset)."""
    if bench.path:
        path = Path(bench.path)
        if not path.is_absolute():
            root = resolve_data_root(data_root)
            if root is None:
                raise FileNotFoundError(
                    f"Benchmark {bench.name!r} has a relative path {bench.path!r}: set `data_root` "
                    f"(e.g. --data_root ARPO/evaluation/data from `git clone https://github.com/dongguanting/ARPO`) or ${DATA_ROOT_ENV}."
                )
            path = Path(root) / path
        if not path.is_file():
            raise FileNotFoundError(f"Benchmark {bench.name!r}: data file {path} not found.")
        rows = _read_rows(path)
        source = str(path)
    else:
        import datasets

        rows = list(datasets.load_dataset(bench.hub, split=bench.split))
        source = str(bench.hub)
    if limit is not None:
        rows = rows[:limit]
    return [parse_row(r, i, bench.answer_format, source) for i, r in enumerate(rows)]


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]
