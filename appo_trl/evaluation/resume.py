"""Safe resume of `appo eval`: an output folder only ever holds samples of one model, one setting, one data set.

`evaluate` skips the samples already in `<output_dir>/samples.jsonl`. That is only right when they were drawn
by the same model, with the same generation settings, for the same questions. `check_resume` stores a
fingerprint of the run in `<output_dir>/run.json` and compares it with the stored one on every rerun:

- `model`: the model name (an existing local path is compared as its absolute path);
- `settings`: the fields of `EvalConfig` that change what a sample is (`SAMPLE_KEYS`); the number of samples,
  `limit`, `ks`, the benchmark list, concurrency and the server URL may change between runs (a resumed run
  adds or reuses samples by their (benchmark, question, sample) key);
- `judge`: the judge model and endpoint, compared only when both runs use a judge (adding a judge later is
  the normal way to re-score stored samples);
- `data`: a hash of each question and its gold answers, by benchmark and row index; only the rows both runs
  share are compared.

A mismatch raises `EvalResumeError` naming every difference; `overwrite_output_dir: true` starts fresh
instead (the stored samples, judgments and reports are removed). An output folder with samples but no
`run.json` (written before this check existed) is refused the same way: its origin cannot be checked.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from appo_trl.configs.errors import ConfigError

RUN_FILE = "run.json"
RUN_OUTPUTS = ("samples.jsonl", "judgments.jsonl", "report.json", "report.md", "report.png", RUN_FILE)
SAMPLE_KEYS = (
    "seed", "temperature", "top_p", "top_k", "repetition_penalty", "max_completion_length", "max_model_len",
    "call_limit", "prompt", "tools", "search_backend", "search_cache", "tool_config",
)  # fmt: skip
JUDGE_KEYS = ("judge_base_url", "judge_model")


class EvalResumeError(ConfigError):
    """`output_dir` holds samples of a different model, setting or data set."""


def _model_id(model: str) -> str:
    expanded = os.path.expanduser(model or "")
    return os.path.abspath(expanded) if model and os.path.exists(expanded) else model


def _example_hash(example) -> str:
    text = json.dumps([example.question, list(example.answers)], ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def fingerprint(config, examples: dict[str, list]) -> dict[str, Any]:
    """The run's identity: model, sample-changing settings, judge, and a hash per question."""
    settings = {k: getattr(config, k) for k in SAMPLE_KEYS}
    if isinstance(settings["tool_config"], str):
        settings["tool_config"] = json.loads(settings["tool_config"])
    return {
        "model": _model_id(config.model),
        "settings": json.loads(json.dumps(settings, default=str)),
        "judge": {k: getattr(config, k) for k in JUDGE_KEYS},
        "data": {name: {str(ex.index): _example_hash(ex) for ex in exs} for name, exs in examples.items()},
    }


def differences(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences that make the stored samples unusable for the current run."""
    out = []
    if stored.get("model") != current["model"]:
        out.append(f"model {stored.get('model')!r} != {current['model']!r}")
    old_settings = stored.get("settings") or {}
    for key, value in current["settings"].items():
        if key in old_settings and old_settings[key] != value:
            out.append(f"{key} {old_settings[key]!r} != {value!r}")
    old_judge = stored.get("judge") or {}
    if old_judge.get("judge_model") and current["judge"].get("judge_model"):
        for key, value in current["judge"].items():
            if old_judge.get(key) != value:
                out.append(f"{key} {old_judge.get(key)!r} != {value!r}")
    for bench, rows in current["data"].items():
        old_rows = (stored.get("data") or {}).get(bench) or {}
        changed = [i for i, h in rows.items() if i in old_rows and old_rows[i] != h]
        if changed:
            out.append(f"benchmark {bench!r}: {len(changed)} question(s) changed (first: row {changed[0]})")
    return out


def check_resume(config, examples: dict[str, list], out_dir: str | os.PathLike) -> None:
    """Refuse (or, with `overwrite_output_dir`, clear) an output folder that holds another run; write run.json."""
    out_dir = Path(out_dir)
    run_file = out_dir / RUN_FILE
    current = fingerprint(config, examples)
    has_samples = (out_dir / "samples.jsonl").is_file() and (out_dir / "samples.jsonl").stat().st_size > 0
    if getattr(config, "overwrite_output_dir", False):
        for name in RUN_OUTPUTS:
            (out_dir / name).unlink(missing_ok=True)
    elif run_file.is_file():
        stored = json.loads(run_file.read_text(encoding="utf-8"))
        diff = differences(stored, current)
        if diff:
            raise EvalResumeError(
                f"output_dir {str(out_dir)!r} holds samples of another run ({'; '.join(diff)}); use another "
                "--output_dir, or --overwrite_output_dir true to start fresh."
            )
        for bench, rows in (stored.get("data") or {}).items():  # keep rows of earlier, larger runs
            current["data"][bench] = {**rows, **current["data"].get(bench, {})}
    elif has_samples:
        raise EvalResumeError(
            f"output_dir {str(out_dir)!r} holds samples without {RUN_FILE}, so their model and settings cannot "
            "be checked; use another --output_dir, or --overwrite_output_dir true to start fresh."
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_file.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(current, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, run_file)
