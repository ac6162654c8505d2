"""Reading a rollout dump back, whatever state it is in: every readable group, and one line for each thing that is not.

`find_dump(output_dir)` lists the step files of `output_dir/rollouts` (`step_<N>.jsonl`, written by
`appo_trl.reporting.rollout_dump`); anything else there that looks like one (`step_final.jsonl`, a folder named like
a step file) is named in `Dump.notes`. A missing folder or one without step files is a `DumpError`: one line saying
what is missing and how to get a dump. `read_step(path)` reads one file line by line and never raises on its
content: a line cut mid-way (what a killed run leaves), bytes that are not UTF-8, a line that is not JSON or not a
group record (a list line) is left out and named in `DumpStep.problems`; a hand-edited record (`reward: null`, no
`strategy`, a parent that is not a row) keeps its good fields, gets the neutral value for the bad one, and is named
there too. Numbers that are not finite become None, so a record is valid JSON for the browser. A dump from before
`advantage_runs` (an older appo-trl) reads, with one note that the token colours are missing.

What this does not do: repair files; it reads what is there and says what is not.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

# row key -> the value a row without it gets (None: not known); "index" and "length" are computed
ROW_DEFAULTS: dict[str, Any] = {
    "uid": "", "parent": None, "origin": "root", "role": None, "run": None, "branch_pos": None, "fork_context": "",
    "reward": None, "advantage": None, "kept": True, "num_calls": 0, "tool_calls": [], "finish_reason": "unknown",
    "completion": "", "continuation": None, "advantage_runs": None, "node_runs": None, "tokens": None,
    "mask_runs": None, "tool_spans": [], "branch_entropy": None, "branch_score": None, "version_runs": None,
}  # fmt: skip
MAX_PROBLEMS = 8  # lines said per file; the rest are counted
NUMBER_KEYS = ("reward", "advantage", "branch_entropy", "branch_score")
RUN_KEYS = {"advantage_runs": 3, "node_runs": 4, "mask_runs": 3, "version_runs": 3}  # key -> entries per run


class DumpError(FileNotFoundError):
    """There is no dump to read (a missing folder, no step files, a step that was not dumped): one line."""


@dataclasses.dataclass
class Dump:
    """The step files of one run's `rollouts/` folder."""

    folder: Path
    steps: dict[int, Path]
    notes: list[str]  # entries that look like step files but are not (each one line)

    def path_of(self, step: int | None) -> Path:
        """The file of `step` (None: the newest); `DumpError` naming the dumped steps when it was not dumped."""
        if step is None:
            return self.steps[max(self.steps)]
        if step not in self.steps:
            raise DumpError(f"No rollouts for step {step} in {self.folder}; dumped steps: {_span(sorted(self.steps))}")
        return self.steps[step]


@dataclasses.dataclass
class DumpStep:
    """One step file read back: its readable groups, and one line per thing left out or fixed up."""

    step: int
    path: Path
    groups: list[dict]
    problems: list[str]


def _span(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 8 else f"{steps[0]}..{steps[-1]} ({len(steps)} steps)"


def find_dump(output_dir: str | Path) -> Dump:
    """The dump under `output_dir/rollouts`; `DumpError` when the run folder, the dump folder or every step file
    is missing."""
    out = Path(output_dir)
    if not out.is_dir():
        raise DumpError(f"{out} is not a folder: give the output_dir of an `appo train` run" if out.exists() else
                        f"{out} does not exist: give the output_dir of an `appo train` run")  # fmt: skip
    folder = out / "rollouts"
    hint = "train with `--dump_rollouts 2` (groups per step) to write some"
    if not folder.is_dir():
        raise DumpError(f"No rollouts in {folder} (no such folder): {hint}.")
    steps, notes = {}, []
    for p in sorted(folder.glob("step_*.jsonl")):
        number = p.stem.split("_", 1)[1]
        if not number.isdigit():
            notes.append(f"{p.name} left out: not a step file (names are step_<N>.jsonl)")
        elif not p.is_file():
            notes.append(f"{p.name} left out: a folder, not a step file")
        else:
            steps[int(number)] = p
    if not steps:
        raise DumpError(f"No rollouts in {folder}{' (' + '; '.join(notes) + ')' if notes else ''}: {hint}.")
    return Dump(folder, steps, notes)


def read_step(path: Path) -> DumpStep:
    """Every readable group of one step file, with one line per line left out or field fixed up (module doc)."""
    step = int(path.stem.split("_", 1)[1])
    try:
        data = path.read_bytes()
    except OSError as exc:
        return DumpStep(step, path, [], [f"{path.name} cannot be read: {exc.strerror or exc}"])
    groups, problems = [], []
    lines = data.split(b"\n")
    cut = bool(lines and lines[-1].strip())  # a file written whole ends with a newline
    if not data.strip():
        problems.append(f"{path.name} is empty")
    older = 0
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"{path.name} line {n}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.append(
                f"{where} left out: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
            )
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            if cut and n == len(lines):
                problems.append(f"{where} left out: cut mid-line after {len(raw)} bytes (the run was stopped while "
                                f"writing it); the lines before it are shown")  # fmt: skip
            else:
                problems.append(f"{where} left out: not JSON ({exc.msg} at column {exc.colno})")
            continue
        group, fixed = check_group(obj, len(groups))
        problems += [f"{where}{' ' if group is None else ': '}{p}" for p in fixed]
        if group is not None:
            groups.append(group)
            older += sum(r["advantage_runs"] is None for r in group["rows"])
    if older:
        problems.append(f"{path.name}: {older} row(s) without advantage_runs (a dump from an older appo-trl): no "
                        f"token colours for them")  # fmt: skip
    if not groups and len(problems) > 1:  # not a dump at all (random bytes): one line, not one per line
        problems = [f"{path.name} left out: no line is a group record ({len(problems)} problems; the first: "
                    f"{problems[0].removeprefix(path.name + ' ')})"]  # fmt: skip
    elif len(problems) > MAX_PROBLEMS:
        problems = problems[:MAX_PROBLEMS] + [f"{path.name}: {len(problems) - MAX_PROBLEMS} more problem(s) not shown"]
    return DumpStep(step, path, groups, problems)


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if isinstance(value, int) or math.isfinite(value) else None  # an int stays one (rows through a node)


def _runs(value, width: int) -> list | None:
    """`[[start, end, value...], ...]` with int bounds and finite numbers (else None: not usable)."""
    if not isinstance(value, list):
        return None
    out = []
    for run in value:
        if not (isinstance(run, list) and len(run) == width and all(isinstance(x, int) for x in run[:2])):
            return None
        out.append([run[0], run[1], *(_number(x) for x in run[2:])])
    return out


def check_group(obj: Any, position: int) -> tuple[dict | None, list[str]]:
    """(the record with every field a reader uses, fixed-up fields named) or (None, why it is left out)."""
    if not isinstance(obj, dict):
        return None, [f"left out: a {type(obj).__name__}, not a group record (an object with rows)"]
    rows = obj.get("rows")
    if not isinstance(rows, list):
        return None, ["left out: no `rows` list"]
    problems = []
    group = dict(obj)
    for key, default in (("group", position), ("strategy", "unknown"), ("prompt", ""), ("answer", None)):
        if key not in obj:
            problems.append(f"no `{key}`")
            group[key] = default
    if not isinstance(group["group"], int) or isinstance(group["group"], bool):
        problems.append(f"`group` is {group['group']!r}, not a number")
        group["group"] = position
    group["prompt"] = str(group["prompt"])
    out_rows = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            problems.append(f"row {i} left out: not an object")
            continue
        out_rows.append(_check_row(row, len(out_rows), problems))
    indices = {r["index"] for r in out_rows}
    for r in out_rows:
        for key in ("parent", "run"):
            if r[key] is not None and r[key] not in indices:
                problems.append(f"row {r['index']}: `{key}` {r[key]!r} is not a row of the group")
                r[key] = None
    group["rows"] = out_rows
    return group, problems


def _check_row(row: dict, position: int, problems: list[str]) -> dict:
    out = {**ROW_DEFAULTS, **row}
    out["index"] = row["index"] if isinstance(row.get("index"), int) else position
    name = f"row {out['index']}"
    for key in NUMBER_KEYS:
        if key in ("reward", "advantage") and key not in row:
            problems.append(f"{name}: no `{key}`")
        elif row.get(key) is not None and _number(row[key]) is None:
            problems.append(f"{name}: `{key}` is {row[key]!r}, not a finite number")
        elif key == "reward" and row.get(key) is None:
            problems.append(f"{name}: `reward` is null")
        out[key] = _number(row.get(key))
    for key, width in RUN_KEYS.items():
        out[key] = _runs(row.get(key), width)
        if row.get(key) is not None and out[key] is None:
            problems.append(f"{name}: `{key}` is not a list of runs")
    for key in ("parent", "run", "branch_pos"):
        if out[key] is not None and (not isinstance(out[key], int) or isinstance(out[key], bool) or out[key] < 0):
            problems.append(f"{name}: `{key}` is {out[key]!r}, not a row position")
            out[key] = None
    if not isinstance(out["tokens"], list) or not all(isinstance(t, str) for t in out["tokens"]):
        out["tokens"] = None
    if not isinstance(out["tool_calls"], list):
        out["tool_calls"] = []
    out["tool_calls"] = [c for c in out["tool_calls"] if isinstance(c, dict)]
    out["num_calls"] = out["num_calls"] if isinstance(out["num_calls"], int) else len(out["tool_calls"])
    length = row.get("length")
    if not isinstance(length, int) or length < 0:
        runs = out["advantage_runs"] or out["mask_runs"]
        length = runs[-1][1] if runs else len(out["tokens"] or [])
        if "length" in row:
            problems.append(f"{name}: `length` is {row['length']!r}, not a token count")
    out["length"] = length
    out["completion"] = str(out["completion"] if out["completion"] is not None else "")
    out["role"] = out["role"] or ("chain" if out["origin"] == "chain" else "row")
    out["kept"] = bool(out["kept"])
    return out
