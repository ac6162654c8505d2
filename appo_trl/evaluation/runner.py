"""The evaluation loop: questions -> k samples each (resumable) -> scores -> optional judge -> report.

Inference is pluggable: `evaluate(config, generate)` takes an async `generate(request) -> Generation`.
`appo eval` passes one built on the training rollout engine (`appo_trl.evaluation.inference`), so the
evaluated model runs the same tool loop, stop tags, call limits and tools as in training; tests pass a
scripted one. Every finished sample is appended to `<output_dir>/samples.jsonl` at once (one JSON line,
flushed), and a rerun with the same `output_dir` generates only the (benchmark, question, sample) keys
that are missing, after checking that the stored samples come from the same model, generation settings and
questions (`appo_trl.evaluation.resume`: a mismatch is refused, or cleared with `overwrite_output_dir`); judge verdicts are cached the same way in `judgments.jsonl` (errors are retried).
Scores are recomputed from the stored completions on every run, so a report always reflects the current
metric code. Each sample's seed is derived from (seed, benchmark, question, sample), so a resumed or
re-ordered run draws the same samples as an uninterrupted one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from appo_trl.evaluation.benchmarks import Benchmark, Example, load_examples, load_registry, system_prompt
from appo_trl.evaluation.config import EvalConfig
from appo_trl.evaluation.resume import check_resume


@dataclasses.dataclass
class Request:
    """One sample to generate: a chat prompt, the tools it may call, its seed, and its key."""

    benchmark: str
    index: int
    sample: int
    messages: list[dict[str, str]]
    tools: list[str]
    seed: int
    call_limit: int

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.benchmark, self.index, self.sample)


@dataclasses.dataclass
class Generation:
    """What the policy produced for one request.

    Args:
        completion: the assistant turn as text, tool results (`<result>...</result>`) included.
        tool_calls: one `{"tag", "ok"}` dict (plus any extras) per tool call, in order.
        finish_reason: why the sample ended (`stop`, `length`, `call_limit`, ...).
        completion_tokens: model-generated tokens (tool-result tokens excluded).
        limit_hit: True when the sample reached the tool call limit.
        meta: anything else worth keeping (JSON-serialisable).
    """

    completion: str
    tool_calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    limit_hit: bool = False
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


GenerateFn = Callable[[Request], Awaitable[Generation]]


def derive_seed(seed: int, benchmark: str, index: int, sample: int) -> int:
    """A 31-bit seed that depends only on (seed, benchmark, question, sample)."""
    digest = hashlib.sha256(f"{seed}/{benchmark}/{index}/{sample}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def default_call_limit(task: str) -> int:
    """The released ARPO/APPO yamls: 3 calls for reasoning (math), 6 for QA and deep search."""
    return 3 if task == "math" else 6


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a jsonl file; a torn last line (a run killed mid-write) is ignored."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def open_append(path: Path):
    """Open a jsonl file for appending; a torn last line (a killed run) is closed with a newline first."""
    out = open(path, "a", encoding="utf-8")
    if out.tell() > 0:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                out.write("\n")
    return out


def record_key(record: dict[str, Any]) -> tuple[str, int, int]:
    return (record["benchmark"], int(record["index"]), int(record["sample"]))


def select_benchmarks(config: EvalConfig) -> list[Benchmark]:
    registry = load_registry(config.registry)
    names = list(registry) if config.benchmarks in (["all"], []) else config.benchmarks
    missing = [n for n in names if n not in registry]
    if missing:
        raise KeyError(f"Unknown benchmarks {missing}; the registry has {sorted(registry)}.")
    benches = []
    for name in names:
        bench = dataclasses.replace(registry[name])
        if config.prompt is not None:
            bench.prompt = config.prompt
        if config.tools is not None:
            bench.tools = list(config.tools)
        benches.append(bench)
    return benches


def build_requests(config: EvalConfig, bench: Benchmark, examples: Iterable[Example]) -> list[Request]:
    system = system_prompt(bench.prompt)
    limit = config.call_limit if config.call_limit is not None else default_call_limit(bench.task)
    requests = []
    for ex in examples:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": ex.question}
        ]
        for s in range(config.num_samples):
            seed = derive_seed(config.seed, bench.name, ex.index, s)
            requests.append(Request(bench.name, ex.index, s, messages, list(bench.tools), seed, limit))
    return requests


async def generate_missing(
    requests: list[Request],
    generate: GenerateFn,
    samples_path: Path,
    concurrency: int,
    show_progress: bool = True,
    progress=None,
) -> int:
    """Generate the requests whose key is not in `samples_path` yet; append each result as it finishes.

    `progress(done, total)`, when given, is called after each finished sample (the demo's progress line).

    A `generate` with an async `aclose()` (e.g. `RolloutGenerator`) is closed when the batch ends.
    """
    done = {record_key(r) for r in read_jsonl(samples_path)}
    todo = [r for r in requests if r.key not in done]
    if not todo:
        return 0
    from tqdm.auto import tqdm

    sem = asyncio.Semaphore(max(1, concurrency))
    bar = tqdm(total=len(todo), desc="generating", unit="sample", disable=not show_progress)
    samples_path.parent.mkdir(parents=True, exist_ok=True)
    with open_append(samples_path) as out:
        failed = asyncio.Event()
        finished: list = []

        async def one(req: Request) -> None:
            async with sem:
                if failed.is_set():  # a sample failed: start nothing new
                    return
                try:
                    gen = await generate(req)
                except BaseException:
                    failed.set()
                    raise
            record = {"benchmark": req.benchmark, "index": req.index, "sample": req.sample, "seed": req.seed,
                      "call_limit": req.call_limit, **dataclasses.asdict(gen)}  # fmt: skip
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            bar.update(1)
            finished.append(req.key)
            if progress is not None:
                progress(len(finished), len(todo))

        tasks = [asyncio.ensure_future(one(r)) for r in todo]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            # stop at the first failure; finished samples are on disk and a rerun resumes from them
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            bar.close()
            aclose = getattr(generate, "aclose", None)
            if aclose is not None:  # tools and clients are closed on the loop that opened them
                await aclose()
    return len(todo)


def judge_missing(config: EvalConfig, items: list[dict[str, Any]], judgments_path: Path, judge=None,
                  show_progress: bool = True) -> dict[tuple, dict[str, Any]]:  # fmt: skip
    """Judge verdicts for scored items (`key`, `question`, `golds`, `prediction`, `rule_correct`).

    Cached verdicts for the same key and prediction are reused; cached errors are retried. Items that
    are already right by rule (exact match / math equivalence) or have an empty prediction need no call.
    """
    cache = {}
    for r in read_jsonl(judgments_path):
        cache[(tuple(r["key"]), r["prediction"])] = r
    out, todo = {}, []
    for item in items:
        key = tuple(item["key"])
        cached = cache.get((key, item["prediction"]))
        if item["rule_correct"]:
            out[key] = {"correct": True, "source": "rule", "error": None}
        elif not item["prediction"].strip():
            out[key] = {"correct": False, "source": "empty", "error": None}
        elif cached is not None and cached.get("error") is None:
            out[key] = cached
        else:
            todo.append(item)
    if todo:
        from tqdm.auto import tqdm

        from appo_trl.evaluation.judge import LLMJudge

        judge = judge or LLMJudge(config.judge)
        bar = tqdm(total=len(todo), desc="judging", unit="sample", disable=not show_progress)
        try:
            verdicts = judge.judge(
                [(i["question"], i["golds"], i["prediction"]) for i in todo], progress=lambda: bar.update(1)
            )
        finally:
            bar.close()
        judgments_path.parent.mkdir(parents=True, exist_ok=True)
        with open_append(judgments_path) as f:
            for item, verdict in zip(todo, verdicts):
                row = {"key": list(item["key"]), "prediction": item["prediction"], "source": "judge", **verdict}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                out[tuple(item["key"])] = row
    return out


def check_output_dir(config: EvalConfig) -> None:
    """The checks that need no model, for callers that load one afterwards: benchmarks, questions, the
    resume check (`run.json`), and the tools the benchmarks use (a search server that is down or not ours)."""
    from types import SimpleNamespace

    from appo_trl.configs.preflight import check_tools

    benches = select_benchmarks(config)
    examples = {b.name: load_examples(b, config.data_root, config.limit) for b in benches}
    check_resume(config, examples, config.output_dir)
    names = sorted({t for b in benches for t in b.tools})
    check_tools(SimpleNamespace(tools=names, tool_config=config.tool_params(names)))


def evaluate(config: EvalConfig, generate: GenerateFn, *, judge=None, show_progress: bool = True,
             progress=None) -> dict[str, Any]:  # fmt: skip
    """Run (or resume) the whole evaluation and write the reports; returns the report dict.

    Args:
        config: the run's `EvalConfig`.
        generate: async `Request -> Generation` (see `appo_trl.evaluation.inference.RolloutGenerator`).
        judge: an object with `judge(items, progress)` (tests); None builds `LLMJudge` when configured.
        show_progress: tqdm progress bars.
        progress: `progress(done, total)` after each generated sample (a line printer), or None.
    """
    from appo_trl.evaluation import metrics
    from appo_trl.evaluation.report import build_report, write_reports

    out_dir = Path(config.output_dir)
    samples_path = out_dir / "samples.jsonl"
    benches = select_benchmarks(config)
    examples = {b.name: load_examples(b, config.data_root, config.limit) for b in benches}
    check_resume(config, examples, out_dir)  # the stored samples are this model's, settings' and questions'
    requests = [r for b in benches for r in build_requests(config, b, examples[b.name])]
    asyncio.run(generate_missing(requests, generate, samples_path, config.concurrency, show_progress, progress))

    wanted = {r.key for r in requests}
    records = {}
    for r in read_jsonl(samples_path):
        if record_key(r) in wanted:
            records[record_key(r)] = r  # the last write of a key wins
    by_index = {b.name: {ex.index: ex for ex in examples[b.name]} for b in benches}
    for key, rec in records.items():
        bench = next(b for b in benches if b.name == key[0])
        ex = by_index[bench.name][key[1]]
        rec["prediction"] = metrics.extract_prediction(rec["completion"])
        rec["golds"] = ex.answers
        rec["scores"] = metrics.score_sample(rec["prediction"], ex.answers, bench.task)

    if config.judge.enabled or judge is not None:
        items = [{"key": list(k), "question": by_index[k[0]][k[1]].question, "golds": r["golds"],
                  "prediction": r["prediction"],
                  "rule_correct": r["scores"]["em"] == 1.0 or r["scores"].get("math_equal", 0.0) == 1.0}
                 for k, r in records.items()]  # fmt: skip
        verdicts = judge_missing(config, items, out_dir / "judgments.jsonl", judge, show_progress)
        for key, rec in records.items():
            v = verdicts[key]
            rec["judge"] = {"correct": v.get("correct"), "source": v.get("source"), "error": v.get("error")}
            rec["scores"]["llm_judge"] = 1.0 if v.get("correct") else 0.0

    report = build_report(config, benches, examples, records, judged=config.judge.enabled or judge is not None)
    write_reports(report, out_dir, records)
    return report
