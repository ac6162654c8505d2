"""The cold start's copying probe: does the model search the entity it is asked about, on unseen entities?

The demo's held-out search and both questions are about entities the model never saw in SFT or RL; solving them
takes one skill above all, copying the entity's name from the question into the search query. A cold start that
has not learned it searches a memorised SFT entity instead (`<search>population of Jaxvux` for "the population of
Yoljor"), and RL has no correct sample to sharpen (docs/benchmarks.md, "Demo").

The traces name the entity and attribute twice, at the start of `<think>` and as the search query
(`<think>Yoljor population: I will search for it.</think><search>Yoljor population</search>`), and a weak
teacher's guess names it too (`<think>Yoljor population: I know it.</think>`). `copy_rate(model, tokenizer,
questions)` decodes greedily from each question's prompt and counts the question as copied when what the model
asks for (its first `<search>` query; a guess, what its `<think>` names) is exactly the question's query
(`copied`); `head_copied` counts those whose entity name has the right first syllable (the first half of the
skill, learned first). Greedy decoding and no tool calls: a cheap, deterministic probe of the skill (the
`make test` guard of the cold start, `tests/test_demo_cold_start.py`), not the held-out evaluation (`appo eval`,
sampled, with the real tools).

`multiplier_copy(model, tokenizer, questions)` probes the both questions' second copy, of the multiplier k: fed the
ideal trace up to the digit, the greedy next token must be k, where the `<think>` states it (`Yoljor population,
times` -> 7) and where the call writes it (`print(452 *` -> 7).
"""

from __future__ import annotations

import re

from appo_trl.synthetic.task import HEADS, MULTIPLIER_MARKER, SYSTEM_PROMPT, TAILS, Question

_QUERY = re.compile(r"<search>(.*?)</search>", re.S)
_THINK = re.compile(r"<think>([^:<]*):")
_CALL = re.compile(r"<python>print\(\d+ \* ")


def _entity(text: str | None) -> str | None:
    """The first word of `text` that is a task name (head + tail syllables)."""
    return next((w for w in (text or "").split() if name_head(w)), None)


def name_head(name: str | None) -> str | None:
    """The first syllable of a task name ("Yol" of "Yoljor"), None if `name` is not a head + tail name."""
    heads = [h for h in HEADS if name and name.startswith(h) and name[len(h) :] in TAILS]
    return heads[0] if heads else None


def _prompt(tokenizer, q: Question) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q.question}],
        tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip


def _greedy(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy continuations of `prompts` (left-padded into one batch), decoded without special tokens."""
    import torch

    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    model.train(was_training)
    return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def copy_rate(model, tokenizer, questions: list[Question], max_new_tokens: int = 64) -> dict:
    """Greedy completions of the search / both `questions`: the share that searches and the share that copies."""
    qs = [q for q in questions if q.query]
    if not qs:
        raise ValueError("copy_rate needs search or both questions")
    texts = _greedy(model, tokenizer, [_prompt(tokenizer, q) for q in qs], max_new_tokens)
    queries = [m.group(1).strip() if (m := _QUERY.search(t)) else None for t in texts]
    # what the model asks for: its first search query, or (a guess) what its <think> names
    named = [query or (m.group(1).split(",")[0].strip() if (m := _THINK.match(t)) else None)
             for t, query in zip(texts, queries)]  # fmt: skip
    copied = [name == q.query for q, name in zip(qs, named)]
    head = [name_head(_entity(q.query)) == name_head(_entity(name)) for q, name in zip(qs, named)]
    return {
        "questions": len(qs),
        "searched": sum(query is not None for query in queries) / len(qs),
        "copied": sum(copied) / len(qs),
        "head_copied": sum(head) / len(qs),
        "samples": [{"question": q.question, "completion": t} for q, t in zip(qs, texts)],
    }


def multiplier_copy(model, tokenizer, questions: list[Question]) -> dict:
    """Teacher-forced through each both question's ideal trace up to its multiplier (in `<think>`, then in the
    call), the share whose greedy next token is the question's k (module head)."""
    qs = [q for q in questions if q.family == "both"]
    if not qs:
        raise ValueError("multiplier_copy needs both questions")
    ks = [q.named.rsplit(MULTIPLIER_MARKER, 1)[1] for q in qs]
    # fed up to the space before k (however the tokenizer joins a space and a digit, the model writes that)
    cut = len(MULTIPLIER_MARKER.rstrip())
    think = [_prompt(tokenizer, q) + q.trace[: q.trace.index(MULTIPLIER_MARKER) + cut] for q in qs]
    call = [_prompt(tokenizer, q) + q.trace[: _CALL.search(q.trace).end() - 1] for q in qs]
    out = {"questions": len(qs)}
    for where, prompts in (("think", think), ("call", call)):
        texts = _greedy(model, tokenizer, prompts, 3)
        out[where] = sum(t.strip()[:1] == k for t, k in zip(texts, ks)) / len(qs)
    return out
