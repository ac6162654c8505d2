"""Dataset loading for the RL and SFT stages: sources, mixtures, ARPO schemas, column mapping, validation.

A *source* is a Hub dataset id, a local `.parquet` / `.jsonl` / `.json` file (its only split is `train`),
or a local folder of such files (splits inferred from file names by `datasets`, e.g. `train_10k.parquet` ->
train, `valid.parquet` -> validation, `*_test.parquet` -> test). A *mixture* is
several sources with weights, written in a recipe either as a mapping or as a string:

```yaml
dataset_name: ../data/arpo/rl/train_10k.parquet                        # one source
dataset_name: {data/math.parquet: 1.0, data/qa.jsonl: 0.25}             # mixture (YAML mapping)
dataset_name: data/math.parquet@1.0,data/qa.jsonl@0.25                  # the same, as a string (CLI)
```

A weight is the fraction of that source's rows to use (open-r1's convention): 0.25 keeps a seeded random
quarter, 2.0 repeats every row twice; the mixture is the concatenation, shuffled with a fixed seed.

RL rows (`load_rl_dataset`) always come out as:

- `prompt`: a list of chat messages `{role, content}`. A string prompt becomes one user message; the
  configured system prompt (registry name from `SYSTEM_PROMPTS` or literal text) is prepended, replacing a
  system message the data already carries.
- `answer`: the gold answer, `str` or `list[str]`; TRL passes it to every reward function as a kwarg. With
  the default `answer_column` the column is optional (rewards that need it are checked at start-up); a
  configured `answer_column` must exist.
- `ability`, `data_source`: copied when the source has them.

ARPO's RL parquet files (verl schema: `prompt` messages, `reward_model.ground_truth`, `ability`,
`data_source`, `extra_info`) load as they are: when the answer column is absent and `reward_model` is
present, the answer is `reward_model.ground_truth`. Their system prompt contains a literal backspace
(`"\\x08oxed"`, an unescaped `"\\b"` in ARPO's export); every message is repaired back to `\\boxed`.
Any column may be a dotted path into a struct column (`answer_column: reward_model.ground_truth`).
A missing column is an error naming the column, the source and the columns found. A local path that does not
exist, an empty data file or an empty split is a `DataError` naming it (never a Hub lookup of a local path).

Bad rows are found while loading, before the model loads, each reported in one line naming the file and the row
(`appo_trl.configs.rows`): a JSON line that is malformed or not UTF-8, a `null` or empty prompt, and, given the
tokenizer and the model's limit, a prompt of more tokens than the sampler can take. With `skip_bad_rows: true`
such rows are dropped instead, counted and logged per file.

SFT rows (`load_sft_dataset`) come out as `messages`; LLaMA-Factory sharegpt records (`system`,
`conversations: [{from, value}]`, ARPO-SFT's format) are converted by `sharegpt_to_messages`.

What this module does not do: tokenisation, templating or masking (see `appo_trl.stages.sft` and the trainer),
and no network access of its own (a Hub id goes through `datasets.load_dataset`, which honours
`HF_HUB_OFFLINE`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from appo_trl.configs.errors import DataError
from appo_trl.configs.paths import DATA_FILE_BUILDERS, looks_local
from appo_trl.configs.rows import find_bad_prompts, scan_json_file

ARPO_ANSWER_PATH = "reward_model.ground_truth"
PASSTHROUGH_COLUMNS = ("ability", "data_source")
MIXTURE_SEED = 42

# System prompts by name (`system_prompt: tir` in a recipe). Literal text works too; these are our own
# wording of the tool-integrated reasoning (TIR) format the rewards check (ARPO's released tool-call format).
_TIR_FORMAT = (
    "Think step by step inside <think> </think>. Whenever a tool helps, call it by writing the call between "
    "its tags and stop; the result comes back between <result> and </result>, after which you continue "
    "thinking. {tools} Finish with <answer> </answer> containing the final answer in LaTeX as \\boxed{{...}}, "
    "for example <answer> The final answer is \\[ \\boxed{{42}} \\] </answer>."
)
SYSTEM_PROMPTS: dict[str, str] = {
    "tir": "You are a helpful assistant that solves problems with a search engine and a python interpreter. "
    + _TIR_FORMAT.format(
        tools="Search with <search> query </search>; run code with <python> code </python> (print what you need)."
    ),
    "tir_search": "You are a helpful assistant that answers questions with a search engine. "
    + _TIR_FORMAT.format(tools="Search with <search> query </search>."),
    "tir_python": "You are a helpful assistant that solves problems with a python interpreter. "
    + _TIR_FORMAT.format(tools="Run code with <python> code </python> (print what you need)."),
    "plain": "You are a helpful assistant. Think step by step, then give the final answer as \\boxed{...}.",
}


class DataPathError(DataError, FileNotFoundError):
    """A local dataset path that does not exist."""


class DatasetColumnError(DataError, KeyError):
    """A configured column is missing from a source (the message names the columns that exist)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


@dataclass(frozen=True)
class DataSource:
    """One entry of a mixture: where the rows come from and which fraction of them to use.

    Args:
        path: Hub id, local data file, or local folder.
        weight: fraction of the source's rows to use (>1 repeats rows).
    """

    path: str
    weight: float = 1.0


def parse_sources(spec: str | Mapping | Sequence | None) -> list[DataSource]:
    """Turn a recipe's `dataset_name` (string, `a@0.5,b@1` string, mapping or list) into `DataSource`s."""
    if spec is None or spec == "":
        raise DataError("No dataset given: set `dataset_name` in the recipe or pass --dataset_name.")
    if isinstance(spec, Mapping):
        items = list(spec.items())
    elif isinstance(spec, str):
        items = []
        for part in (p.strip() for p in spec.split(",")):
            path, at, weight = part.rpartition("@") if "@" in part else (part, "", "")
            items.append((path, float(weight)) if at else (part, 1.0))
    else:
        items = []
        for entry in spec:
            if isinstance(entry, Mapping):
                items.append((entry["path"], entry.get("weight", 1.0)))
            else:
                items.append((str(entry), 1.0))
    sources = [DataSource(str(path), float(weight)) for path, weight in items]
    for s in sources:
        if not s.path or s.weight <= 0:
            raise DataError(f"Invalid dataset source {s}: needs a path and a weight > 0.")
    return sources


def load_source(path: str, split: str = "train", config_name: str | None = None, skip_bad_rows: bool = False):
    """Load one split of one source (Hub id, data file or folder) as a `datasets.Dataset`.

    A JSON / JSON-lines file is checked line by line first (`scan_json_file`): malformed or non-UTF-8 lines are a
    `DataError` naming the line, or are dropped with `skip_bad_rows`.
    """
    import datasets

    expanded = os.path.expanduser(path)
    if os.path.isfile(expanded):
        builder = DATA_FILE_BUILDERS.get(os.path.splitext(expanded)[1].lower())
        if builder is None:
            raise DataError(f"Unsupported data file {path!r}: use one of {sorted(DATA_FILE_BUILDERS)}.")
        if split != "train":  # never hand the training rows back as an evaluation split
            raise DataError(
                f"{path!r} is a single file, which only provides the 'train' split, not {split!r}; "
                "point dataset_name at a folder with per-split files (e.g. train.parquet, test.parquet)."
            )
        if builder == "json" and not _has_content(expanded):
            raise DataError(f"Dataset file {path!r} is empty (no records).")
        if builder == "json":
            expanded = scan_json_file(expanded, skip_bad_rows)
        ds = datasets.load_dataset(builder, data_files=expanded, split="train")
    elif os.path.isdir(expanded) or looks_local(path):
        if not os.path.isdir(expanded):
            raise DataPathError(f"Dataset path {path!r} does not exist (looked for {os.path.abspath(expanded)}).")
        loaded = datasets.load_dataset(expanded)
        ds = _split(loaded, split, path)
    else:
        try:
            loaded = datasets.load_dataset(path, name=config_name)
        except (ConnectionError, FileNotFoundError, OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DataError(
                f"Dataset {path!r} is not a local file or folder (no {os.path.abspath(expanded)}) and could not be "
                f"loaded from the Hub: {first}"
            ) from exc
        ds = _split(loaded, split, path)
    if len(ds) == 0:
        raise DataError(f"Dataset {path!r} has no rows in split {split!r}.")
    return ds


def _has_content(path: str) -> bool:
    with open(path, "rb") as fh:
        return any(line.strip() for line in fh)


def _split(loaded, split: str, path: str):
    if split not in loaded:
        raise DataError(f"Split {split!r} not found in {path!r}; available splits: {sorted(loaded)}.")
    return loaded[split]


def load_mixture(
    sources: Sequence[DataSource],
    split: str = "train",
    config_name: str | None = None,
    convert=None,
    seed: int = MIXTURE_SEED,
    skip_bad_rows: bool = False,
):
    """Load, convert (`convert(dataset, source_path) -> Dataset`), subsample by weight, concatenate, shuffle."""
    import datasets

    parts = []
    for source in sources:
        ds = load_source(source.path, split, config_name, skip_bad_rows)
        if convert is not None:
            ds = convert(ds, source.path)
        parts.append(_apply_weight(ds, source.weight, seed))
    if len(parts) == 1:
        return parts[0]
    parts = _align_answer_types(parts)
    return datasets.concatenate_datasets(parts).shuffle(seed=seed)


def _apply_weight(ds, weight: float, seed: int):
    import datasets

    if weight == 1.0:
        return ds
    whole, frac = int(weight), weight - int(weight)
    pieces = [ds] * whole
    n = math.ceil(frac * len(ds))
    if n:
        pieces.append(ds.shuffle(seed=seed).select(range(n)))
    return datasets.concatenate_datasets(pieces) if len(pieces) > 1 else pieces[0]


def _align_answer_types(parts):
    """Mixtures whose sources disagree on `answer` being str or list[str] become list[str] everywhere."""
    from datasets import Sequence as DsSequence

    kinds = {
        isinstance(p.features.get("answer"), DsSequence) or _is_list_feature(p.features.get("answer"))
        for p in parts
        if "answer" in p.features
    }
    if len(kinds) < 2:
        return parts
    return [
        p
        if _is_list_feature(p.features["answer"])
        else p.map(lambda r: {"answer": [r["answer"]]}, desc="answer -> list")
        for p in parts
    ]


def _is_list_feature(feature) -> bool:
    from datasets import LargeList, List

    return isinstance(feature, (List, LargeList))


# --------------------------------------------------------------------------------------------------- RL rows


def repair_text(text: str) -> str:
    """Repair ARPO's export defect: a literal backspace where `\\b` was meant (`"\\x08oxed"` -> `"\\boxed"`)."""
    return text.replace("\x08", "\\b") if isinstance(text, str) else text


def resolve_system_prompt(name_or_text: str | None) -> str | None:
    """A `SYSTEM_PROMPTS` name maps to its text; anything else is used literally; None means none."""
    if not name_or_text:
        return None
    return SYSTEM_PROMPTS.get(name_or_text, name_or_text)


def get_column(row: Mapping, path: str) -> Any:
    """`row["a"]["b"]` for `path="a.b"` (struct columns)."""
    value: Any = row
    for key in path.split("."):
        value = value[key]
    return value


def has_column(features: Mapping, path: str) -> bool:
    head, _, rest = path.partition(".")
    if head not in features:
        return False
    return not rest or (isinstance(features[head], Mapping) and has_column(features[head], rest))


def _require(features: Mapping, column: str, what: str, source: str) -> None:
    if not has_column(features, column):
        raise DatasetColumnError(
            f"Dataset {source!r} has no {what} column {column!r}; columns found: {sorted(features)}. "
            f"Set `{what}_column` in the recipe to the right column (dotted paths reach into structs)."
        )


def to_messages(prompt: Any, system_prompt: str | None) -> list[dict[str, str]]:
    """A prompt (text or messages) as chat messages, with `system_prompt` in front when given."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    if system_prompt is not None:
        messages = [{"role": "system", "content": system_prompt}] + [m for m in messages if m["role"] != "system"]
    return [{"role": m["role"], "content": repair_text(m["content"])} for m in messages]


def normalize_answer(answer: Any) -> str | list[str]:
    """Gold answers as `str`, or `list[str]` when the data holds several acceptable answers."""
    if isinstance(answer, str):
        return answer
    if answer is None:
        raise DataError("A row has no gold answer (None).")
    if isinstance(answer, (list, tuple)) or hasattr(answer, "tolist"):
        values = answer.tolist() if hasattr(answer, "tolist") else list(answer)
        return [str(v) for v in values]
    return str(answer)


def rl_converter(prompt_column: str = "prompt", answer_column: str = "answer", system_prompt: str | None = None,
                 tokenizer=None, max_prompt_tokens: tuple[int, str] | None = None,
                 skip_bad_rows: bool = False):  # fmt: skip
    """A `convert(dataset, source)` function producing RL rows (`prompt`, `answer`, `ability`, `data_source`).

    Rows with a null or empty prompt, or (given `tokenizer` and `max_prompt_tokens = (limit, what sets it)`) a
    rendered prompt of `limit` tokens or more, raise a `DataError` naming the source and row, or are dropped
    with `skip_bad_rows`.
    """
    system_text = resolve_system_prompt(system_prompt)

    def drop_bad_rows(ds, source: str):
        prompts = [get_column(row, prompt_column) for row in ds] if "." in prompt_column else ds[prompt_column]
        bad = find_bad_prompts(source, prompts, lambda p: to_messages(p, system_text), tokenizer, max_prompt_tokens)
        bad.resolve(skip_bad_rows)
        return bad.drop_from(ds)

    def convert(ds, source: str):
        features = ds.features
        answer_col = answer_column
        if not has_column(features, answer_col) and answer_col == "answer" and has_column(features, ARPO_ANSWER_PATH):
            answer_col = ARPO_ANSWER_PATH  # ARPO / verl schema
        _require(features, prompt_column, "prompt", source)
        # the default `answer` column is optional (a format-only or custom reward may need none); rewards that
        # need gold answers are checked against the loaded columns at start-up (appo_trl.configs.preflight)
        with_answer = has_column(features, answer_col)
        if answer_column != "answer" or with_answer:
            _require(features, answer_col, "answer", source)
        keep = [c for c in PASSTHROUGH_COLUMNS if c in features]
        ds = drop_bad_rows(ds, source)

        def row_fn(row):
            out = {"prompt": to_messages(get_column(row, prompt_column), system_text)}
            if with_answer:
                out["answer"] = normalize_answer(get_column(row, answer_col))
            for c in keep:
                out[c] = None if row[c] is None else str(row[c])
            return out

        return ds.map(
            row_fn,
            remove_columns=ds.column_names,
            features=_rl_features(ds, answer_col if with_answer else None, keep),
            desc=f"RL rows from {os.path.basename(source)}",
        )

    return convert


def _rl_features(ds, answer_col: str | None, keep: Sequence[str]):
    from datasets import Features, List, Value

    feats = {"prompt": List({"role": Value("string"), "content": Value("string")})}
    if answer_col is not None:
        sample = get_column(ds[0], answer_col) if len(ds) else ""
        is_list = isinstance(sample, (list, tuple)) or hasattr(sample, "tolist")
        feats["answer"] = List(Value("string")) if is_list and not isinstance(sample, str) else Value("string")
    feats.update({c: Value("string") for c in keep})
    return Features(feats)


def load_rl_dataset(script_args, split: str | None = None, tokenizer=None,
                    max_prompt_tokens: tuple[int, str] | None = None):  # fmt: skip
    """RL training rows from `script_args` (an `APPOScriptArguments`): the function `appo train` calls.

    Reads `dataset_name` (source or mixture), `dataset_config`, `dataset_train_split` (or `split`),
    `prompt_column`, `answer_column`, `system_prompt`, `skip_bad_rows`. Returns a `datasets.Dataset` with
    `prompt` (messages), `answer` and, when present, `ability` / `data_source`. With `tokenizer` and
    `max_prompt_tokens = (limit, what sets it)`, prompts of `limit` tokens or more are bad rows too.
    """
    skip = bool(getattr(script_args, "skip_bad_rows", False))
    convert = rl_converter(
        prompt_column=script_args.prompt_column,
        answer_column=script_args.answer_column,
        system_prompt=getattr(script_args, "system_prompt", None),
        tokenizer=tokenizer,
        max_prompt_tokens=max_prompt_tokens,
        skip_bad_rows=skip,
    )
    return load_mixture(
        parse_sources(script_args.dataset_name),
        split=split or script_args.dataset_train_split,
        config_name=getattr(script_args, "dataset_config", None),
        convert=convert,
        skip_bad_rows=skip,
    )


# -------------------------------------------------------------------------------------------------- SFT rows

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "observation": "tool",
    "function_call": "assistant",
    "tool": "tool",
}


def sharegpt_to_messages(
    row: Mapping, system_column: str = "system", conversations_column: str = "conversations"
) -> list[dict[str, str]]:
    """LLaMA-Factory sharegpt (`system`, `conversations: [{from, value}]`) -> chat `messages`."""
    messages = []
    system = row.get(system_column)
    if system:
        messages.append({"role": "system", "content": repair_text(system)})
    for turn in row[conversations_column]:
        role = SHAREGPT_ROLES.get(turn["from"])
        if role is None:
            raise ValueError(f"Unknown sharegpt role {turn['from']!r}; known: {sorted(SHAREGPT_ROLES)}.")
        messages.append({"role": role, "content": repair_text(turn["value"])})
    return messages


def _chat_message(m) -> dict:
    """A chat message with `role`/`content`, keeping chat-format tool calls (`tool_calls` as a JSON string, the
    tool message's `name`) so that every row has the same columns whatever its roles."""
    out = {"role": m["role"], "content": m.get("content") or ""}
    calls, name = m.get("tool_calls"), m.get("name")
    out["tool_calls"] = (calls if isinstance(calls, str) else json.dumps(calls)) if calls else None
    out["name"] = name
    return out


def sft_converter(messages_column: str = "messages", system_prompt: str | None = None):
    """A `convert(dataset, source)` producing `messages` rows from `messages` or sharegpt data."""
    system_text = resolve_system_prompt(system_prompt)

    def convert(ds, source: str):
        features = ds.features
        if messages_column in features:
            fields = getattr(features[messages_column], "feature", None)
            if isinstance(fields, dict) and set(fields) <= {"role", "content"}:
                get = lambda row: [{"role": m["role"], "content": m["content"]} for m in row[messages_column]]  # noqa: E731
            else:  # messages with more fields (chat-format `tool_calls`, tool `name`): keep those two
                get = lambda row: [_chat_message(m) for m in row[messages_column]]  # noqa: E731
        elif "conversations" in features:
            get = sharegpt_to_messages
        else:
            raise DatasetColumnError(
                f"Dataset {source!r} has neither a {messages_column!r} column (chat messages) nor a "
                f"'conversations' column (sharegpt); columns found: {sorted(features)}."
            )

        def row_fn(row):
            messages = get(row)
            if system_text is not None:
                messages = [{"role": "system", "content": system_text}] + [
                    m for m in messages if m["role"] != "system"
                ]
            out = {"messages": [{**m, "content": repair_text(m["content"] or "")} for m in messages]}
            if "tools" in features:  # TRL's per-row tool schemas (list or JSON string), rendered by the template
                out["tools"] = row["tools"] if isinstance(row["tools"], str) else json.dumps(row["tools"])
            return out

        return ds.map(row_fn, remove_columns=ds.column_names, desc=f"SFT rows from {os.path.basename(source)}")

    return convert


def load_sft_dataset(
    dataset_name,
    split: str = "train",
    config_name: str | None = None,
    messages_column: str = "messages",
    system_prompt: str | None = None,
):
    """SFT rows (`messages`) from a source or mixture of `messages` or sharegpt data."""
    return load_mixture(
        parse_sources(dataset_name),
        split=split,
        config_name=config_name,
        convert=sft_converter(messages_column, system_prompt),
    )
