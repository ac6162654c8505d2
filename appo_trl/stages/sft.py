"""The SFT cold-start stage: TRL's `SFTTrainer` on tool-integrated reasoning traces, with tool results masked.

ARPO's cold start fine-tunes on traces where the whole agent episode is one assistant turn with tool
results spliced inline (`...<python>code</python><result>\\nout\\n</result><think>...`). Training on the
`<result>` text teaches the model to hallucinate tool outputs (ARPO issue #9), so by default this stage
masks those spans out of the loss: a token is trained iff it belongs to an assistant turn
(`assistant_only_loss`, from the chat template's `{% generation %}` markers; TRL's training templates are
swapped in for models whose template lacks them) and does not overlap a `<result>...</result>` span,
tags included (`mask_tool_results`). An unclosed `<result>` is masked to the end of the text.

How: each conversation is rendered with the chat template and tokenised once with character offsets;
the assistant mask comes from `apply_chat_template(return_assistant_tokens_mask=True)` on the same ids
(checked equal), and result spans are found in the rendered text. The rows handed to `SFTTrainer` are
pre-tokenised (`input_ids`, `assistant_masks`): TRL 1.16 builds `labels` from `assistant_masks`,
truncates to `max_length` (dropping rows left without a trained token) and packs (`packing`) itself.

Chat-format traces (TRL's tool-calling shape: assistant messages with `tool_calls`, `tool` messages, and a
per-row `tools` column of JSON schemas) are rendered with `tools=` so that the prompt matches what RL with
`tool_format: chat` shows the model. The tool turns lie outside the template's generation markers, so
`assistant_only_loss` already leaves them out; `mask_tool_results` also masks every `tool` message's content
when `assistant_only_loss` is off.

Entry points: `main(script_args, training_args, model_args)` (parsed recipe -> finished trainer) and
`cli(argv)` (`appo sft`, `sft/train.py`; relaunches through `accelerate launch` with launch flags).
What this module does not do: generate SFT data, or train on anything but chat conversations.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from trl import ScriptArguments, SFTConfig

logger = logging.getLogger("appo_trl.stages.sft")


@dataclass
class SFTScriptArguments(ScriptArguments):
    """Script arguments of `appo sft`: where the conversations come from.

    Args:
        dataset_name: hub id, local parquet/jsonl file or folder, or a weighted mixture (see `appo_trl.data`).
        messages_column: column with chat messages; LLaMA-Factory sharegpt data (`system`, `conversations`)
            is detected and converted when this column is absent.
        system_prompt: system message for every conversation (a `appo_trl.data.SYSTEM_PROMPTS` name or text),
            replacing the data's own; unset keeps the data's.
    """

    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub id, local parquet/jsonl file or folder, or a weighted mixture."}
    )
    messages_column: str = field(
        default="messages", metadata={"help": "Column with chat messages (sharegpt `conversations` is detected)."}
    )
    system_prompt: str | None = field(
        default=None, metadata={"help": "System prompt name (appo_trl.data.SYSTEM_PROMPTS) or literal text."}
    )


@dataclass
class APPOSFTConfig(SFTConfig):
    """TRL's `SFTConfig` with appo-trl's defaults for tool-integrated traces.

    Args:
        assistant_only_loss: train on assistant tokens only (default True here; TRL's default is False).
        mask_tool_results: also exclude `tool_result_open ... tool_result_close` spans (tags included) from the
            loss: tool output is not the model's to learn.
        tool_result_open, tool_result_close: the tags around injected tool results.
        truncate_long_rows: let TRL truncate rows longer than `max_length`. Off by default: a truncated trace
            loses its last trained tokens, the final answer included, and a tool trace that never ends is what
            the model then learns. Where `max_length` would truncate a row, SFT stops before the model loads
            with one line naming how many rows and the longest length (packing that splits overflow instead,
            `packing_strategy` `bfd_split` or `wrapped`, loses nothing and is not checked).
    """

    assistant_only_loss: bool = field(
        default=True, metadata={"help": "Compute the loss on assistant tokens only (chat template markers)."}
    )
    mask_tool_results: bool = field(
        default=True, metadata={"help": "Exclude <result>...</result> spans (tags included) from the loss."}
    )
    tool_result_open: str = field(default="<result>", metadata={"help": "Opening tag of an injected tool result."})
    tool_result_close: str = field(default="</result>", metadata={"help": "Closing tag of an injected tool result."})
    truncate_long_rows: bool = field(
        default=False, metadata={"help": "Let TRL truncate rows longer than max_length (default: an error)."}
    )


def dataclass_types() -> tuple[type, ...]:
    from trl import ModelConfig

    return (SFTScriptArguments, APPOSFTConfig, ModelConfig)


def result_spans(text: str, open_tag: str = "<result>", close_tag: str = "</result>") -> list[tuple[int, int]]:
    """Character spans `[start, end)` of `open_tag ... close_tag` (tags included; unclosed runs to the end)."""
    pattern = re.compile(re.escape(open_tag) + r".*?(?:" + re.escape(close_tag) + r"|\Z)", re.DOTALL)
    return [m.span() for m in pattern.finditer(text)]


def _assistant_result_spans(text: str, messages, open_tag: str, close_tag: str) -> list[tuple[int, int]]:
    """Result spans inside assistant contents, located verbatim in the rendered text (whole text as fallback)."""
    spans, pos = [], 0
    for message in messages:
        if message["role"] != "assistant":
            continue
        start = text.find(message["content"], pos)
        if start < 0:  # the template rewrote the content: search the whole rendered text instead
            return result_spans(text, open_tag, close_tag)
        spans += [(start + s, start + e) for s, e in result_spans(message["content"], open_tag, close_tag)]
        pos = start + len(message["content"])
    return spans


def chat_messages(messages) -> list[dict]:
    """Messages as the chat template expects them: `tool_calls` decoded from JSON strings, empty fields dropped."""
    out = []
    for m in messages:
        m = {k: v for k, v in dict(m).items() if v is not None or k == "content"}
        if isinstance(m.get("tool_calls"), str):
            m["tool_calls"] = json.loads(m["tool_calls"])
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    return out


def _tool_content_spans(text: str, messages, render) -> list[tuple[int, int]]:
    """Character spans of the `tool` messages' contents in the rendered text. Each is searched from where the
    conversation before it ends (`render(messages[:i])`), so a result equal to text of the call is not confused."""
    spans = []
    for i, message in enumerate(messages):
        content = message.get("content") or ""
        if message["role"] != "tool" or not content:
            continue
        prefix = render(messages[:i])
        at = text.find(content, len(prefix) if text.startswith(prefix) else 0)
        if at >= 0:
            spans.append((at, at + len(content)))
    return spans


def training_chat_template(tokenizer, required: bool = True) -> str | None:
    """The template TRL's trainers render training rows with: None (the tokenizer's own) when it has
    `{% generation %}` markers and keeps prefixes, else TRL's training variant (`get_training_chat_template`, e.g.
    its `qwen3_training.jinja`, as `SFTTrainer(assistant_only_loss=True)` and `GRPOTrainer(tools=...)` swap in).
    A template TRL cannot patch: TRL's `ValueError` when `required` (assistant masks), else None."""
    from trl.chat_template_utils import get_training_chat_template

    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return get_training_chat_template(tokenizer)
    except ValueError:
        if required:
            raise
        return None


def tokenize_conversation(
    messages,
    tokenizer,
    *,
    chat_template: str | None = None,
    assistant_only_loss: bool = True,
    mask_tool_results: bool = True,
    open_tag: str = "<result>",
    close_tag: str = "</result>",
    tools: list | str | None = None,
) -> dict[str, list[int]]:
    """Token ids of a conversation and its loss mask (`assistant_masks`: 1 = trained).

    `tools`: JSON schemas (a list or a JSON string, TRL's `tools` column) rendered by the template.
    `chat_template` None: `training_chat_template(tokenizer)` (TRL's training variant where it has one).
    Raises `ValueError` when `assistant_only_loss` is set but the template marks no assistant token.
    """
    messages = chat_messages(messages)
    tools = (json.loads(tools) if isinstance(tools, str) else tools) or None
    if chat_template is None:
        chat_template = training_chat_template(tokenizer, required=assistant_only_loss)

    def render(msgs):
        return tokenizer.apply_chat_template(msgs, chat_template=chat_template, tokenize=False, tools=tools)

    text = render(messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids, offsets = enc["input_ids"], enc["offset_mapping"]
    if assistant_only_loss:
        processed = tokenizer.apply_chat_template(
            messages, chat_template=chat_template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
            tools=tools,
        )  # fmt: skip
        if list(processed["input_ids"]) != list(input_ids):
            raise ValueError(
                "Tokenising the rendered chat differs from apply_chat_template's ids; cannot align masks."
            )
        mask = [int(bool(b)) for b in processed["assistant_masks"]]
        if 1 not in mask:
            raise ValueError(
                "assistant_only_loss=True but the chat template marks no assistant token: it needs "
                "{% generation %} ... {% endgeneration %} around assistant content."
            )
    else:
        mask = [1] * len(input_ids)
    if mask_tool_results:
        spans = _assistant_result_spans(text, messages, open_tag, close_tag) + _tool_content_spans(
            text, messages, render
        )
        for start, end in spans:
            for i, (s, e) in enumerate(offsets):
                if s < end and e > start:
                    mask[i] = 0
    return {"input_ids": list(input_ids), "assistant_masks": mask}


def tokenize_sft_dataset(dataset, tokenizer, training_args, messages_column: str = "messages"):
    """Map `messages` rows to pre-tokenised rows (`input_ids`, `assistant_masks`) that `SFTTrainer` accepts."""
    chat_template = training_chat_template(tokenizer, required=training_args.assistant_only_loss)
    if chat_template is None and isinstance(tokenizer.chat_template, str):
        chat_template = tokenizer.chat_template  # checked once here, not per row
    kwargs = dict(
        chat_template=chat_template,
        assistant_only_loss=training_args.assistant_only_loss,
        mask_tool_results=training_args.mask_tool_results,
        open_tag=training_args.tool_result_open,
        close_tag=training_args.tool_result_close,
    )
    return dataset.map(
        lambda row: tokenize_conversation(row[messages_column], tokenizer, tools=row.get("tools"), **kwargs),
        remove_columns=dataset.column_names,
        num_proc=training_args.dataset_num_proc,
        desc="Tokenising and masking conversations",
    )


def check_row_lengths(dataset, training_args) -> None:
    """Raise `DataError` when TRL would truncate a pre-tokenised row (see `APPOSFTConfig.truncate_long_rows`)."""
    from appo_trl.configs.errors import DataError

    limit = training_args.max_length
    splits = training_args.packing and training_args.packing_strategy in ("bfd_split", "wrapped")
    if limit is None or splits or training_args.truncate_long_rows:
        return
    lengths = [len(ids) for ids in dataset["input_ids"]]
    long = [n for n in lengths if n > limit]
    if long:
        raise DataError(
            f"{len(long)} of {len(lengths)} SFT rows are longer than max_length={limit} tokens (the longest has "
            f"{max(long)}): TRL would truncate them and drop their last tokens, answers included; raise max_length "
            f"to at least {max(long)}, set it to null, or set truncate_long_rows: true"
        )


@functools.cache
def sft_trainer_class() -> type:
    """TRL's `SFTTrainer` with atomic checkpoint saves (`appo_trl.trainer.checkpoints.AtomicCheckpointMixin`);
    built on first use so that `appo sft --help` does not import the trainer."""
    from trl import SFTTrainer

    from appo_trl.trainer.checkpoints import AtomicCheckpointMixin

    class APPOSFTTrainer(AtomicCheckpointMixin, SFTTrainer):
        """TRL's `SFTTrainer`; a checkpoint is written to a staging folder, then renamed into place."""

    return APPOSFTTrainer


def main(script_args, training_args, model_args, recipe=None, callbacks=None):
    """Run SFT with parsed arguments and return the trainer; saves to `output_dir`, pushes when asked.

    `callbacks` go to TRL's `SFTTrainer` as they are (the demo's progress line).

    `recipe` is what the model card prints (default: every setting that differs from its default).
    """
    from transformers import AutoTokenizer, set_seed
    from trl import get_peft_config

    from appo_trl.data import load_sft_dataset
    from appo_trl.reporting.console import install_step_line
    from appo_trl.reporting.hub import defer_push, push_model
    from appo_trl.reporting.trackers import prepare_trackers
    from appo_trl.stages.logs import setup_logging
    from appo_trl.trainer.checkpoints import resolve_resume_checkpoint, save_final_model

    setup_logging()  # INFO; request loggers at WARNING; agent endpoint secrets redacted
    prepare_trackers(training_args)  # a missing tracker package fails here; wandb offline without an account
    from appo_trl.configs import preflight

    preflight.check_model_source(model_args.model_name_or_path, model_args.model_revision)
    set_seed(training_args.seed)
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    preflight.check_quantization(model_args, training_args)  # QLoRA, or a clear error: never ignored
    preflight.check_output_dir(training_args.output_dir)  # read-only or missing parent: one line, before the model
    preflight.check_hub(training_args)  # before the model loads, not after training
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)
    dataset = load_sft_dataset(
        script_args.dataset_name,
        split=script_args.dataset_train_split,
        config_name=script_args.dataset_config,
        messages_column=script_args.messages_column,
        system_prompt=script_args.system_prompt,
    )
    with training_args.main_process_first(desc="SFT tokenisation"):
        train_dataset = tokenize_sft_dataset(dataset, tokenizer, training_args)
    check_row_lengths(train_dataset, training_args)  # before the model loads
    # The rows are pre-tokenised with the mask applied; TRL must not redo (or reject) assistant-only masking.
    # (So the saved training_args.bin shows assistant_only_loss=False; the model card shows the recipe's value.)
    settings = (script_args, training_args, model_args)
    push = defer_push(training_args)
    assistant_only_loss, training_args.assistant_only_loss = training_args.assistant_only_loss, False
    trainer = sft_trainer_class()(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        callbacks=callbacks,
    )
    install_step_line(trainer, label="SFT")  # `appo train`'s one line per step, no bar in a log file
    state = trainer.accelerator.state
    logger.info("process %d of world_size=%d (%s)", state.process_index, state.num_processes, state.distributed_type)
    checkpoint = resolve_resume_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir)
    if checkpoint is None:  # a SIGTERM line must not name another run's checkpoint
        from appo_trl.stages.interrupts import note_fresh_start

        note_fresh_start(training_args.output_dir)
    trainer.train(resume_from_checkpoint=checkpoint)
    save_final_model(trainer, training_args.output_dir, save_state=False)  # a full disk: one line, no half model
    training_args.assistant_only_loss = assistant_only_loss
    logger.info("Saved model to %s", training_args.output_dir)
    if push:
        training_args.push_to_hub = True
        url = push_model(trainer, algorithm="sft", args=settings, recipe=recipe)
        if url:
            logger.info("Pushed to %s", url)
    return trainer


def cli(argv: Sequence[str] | None = None, entry_script: str | None = None) -> int:
    """`appo sft` / `sft/train.py`: parse the recipe (relaunching under accelerate when asked) and train."""
    from appo_trl.configs.errors import ConfigError
    from appo_trl.configs.recipes import RecipeError, check_before_relaunch, maybe_relaunch, parse_recipe

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        precision = check_before_relaunch(dataclass_types(), argv)  # the launch trains in the recipe's precision
    except ConfigError as exc:
        print(f"appo sft: {exc}", file=sys.stderr)
        return 2
    code = maybe_relaunch(argv, entry_script or __file__, precision)
    if code is not None:
        return code
    try:
        args = parse_recipe(dataclass_types(), argv)
    except RecipeError as exc:
        print(f"appo sft: {exc}", file=sys.stderr)
        return 2
    from appo_trl.reporting.hub import recipe_from_argv
    from appo_trl.stages.interrupts import run_interruptible

    # Ctrl-C and SIGTERM: one line naming the checkpoint kept, exit code 130 / 143
    return run_interruptible("appo sft", args[1].output_dir, lambda: main(*args, recipe=recipe_from_argv(argv)))


if __name__ == "__main__":
    sys.exit(cli())
