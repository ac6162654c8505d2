"""The cold start's copying probe: does the model search the entity it is asked about, on unseen entities?

The demo's held-out search and both questions are about entities the model never saw in SFT or RL; solving them
takes one skill above all, copying the entity's name from the question into the search query. A cold start that
has not learned it searches a memorised SFT entity instead (`<search>population of Jaxvux` for "the population of
Yoljor"), and RL has no correct sample to sharpen (docs/benchmarks.md, "Demo").

The traces name the entity and attribute twice, at the start of `<think>` and as the search query
(`<think>Yoljor population: I will search for it.</think><search>Yoljor population</search>`), and a weak
teacher's guess names it too (`<think>Yoljor population: I know it.</think>`). `copy_rate(model, tokenizer,
questions)` decodes greedily from each question's prompt and counts the question as copied when the `<think>`
starts with exactly the question's `<name> <attr>` and the first `<search>` query, if the model searches, is the
same. Greedy decoding and no tool calls: a cheap, deterministic probe of the skill (the `make test` guard of the
cold start, `tests/test_demo_cold_start.py`), not the held-out evaluation (`appo eval`, sampled, real tools).
"""

from __future__ import annotations

import re

from appo_trl.synthetic.task import SYSTEM_PROMPT, Question

_QUERY = re.compile(r"<search>(.*?)</search>", re.S)
_THINK = re.compile(r"<think>([^:<]*):")


def copy_rate(model, tokenizer, questions: list[Question], max_new_tokens: int = 64) -> dict:
    """Greedy completions of the search / both `questions`: the share that searches and the share that copies."""
    import torch

    qs = [q for q in questions if q.query]
    if not qs:
        raise ValueError("copy_rate needs search or both questions")
    prompts = [
        tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                       {"role": "user", "content": q.question}],
                                      tokenize=False, add_generation_prompt=True)  # fmt: skip
        for q in qs
    ]
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
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    queries = [m.group(1).strip() if (m := _QUERY.search(t)) else None for t in texts]
    named = [m.group(1).strip() if (m := _THINK.match(t)) else None for t in texts]
    copied = [name == q.query and query in (None, q.query) for q, name, query in zip(qs, named, queries)]
    return {
        "questions": len(qs),
        "searched": sum(query is not None for query in queries) / len(qs),
        "copied": sum(copied) / len(qs),
        "samples": [{"question": q.question, "completion": t} for q, t in zip(qs, texts)],
    }
