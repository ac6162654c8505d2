"""A synthetic tool-use task generated from a seed: arithmetic for `python`, invented facts for `search`, and both.

Three question families, each answerable only with the tools (a tiny model cannot multiply 3-digit numbers in
its head, and the facts are invented, so no pretraining could know them):

- `python`: "What is 137 * 4 + 5?"; the trace copies the expression into `print(...)` and boxes the printed value
  (3 or 4 digits, as the other families' answers: `ANSWER_DIGITS`).
- `search`: "What is the capital of Velmora?"; the trace names what it looks for (`<think>Velmora capital: I will
  search for it.</think>`), searches `Velmora capital` in the generated encyclopedia (one document per fact: "The
  capital of Velmora is Tarsk.") and boxes the value it reads.
- `both`: "What is the population of Velmora times 7?"; the trace states the multiplier after the entity
  (`<think>Velmora population, times 7: ...`, `MULTIPLIER_MARKER`), searches the population, then `print(452 * 7)`.

A fourth family, `chain` (`appo_trl.synthetic.chains`), needs 3 to 5 dependent calls; it is opt-in
(`families=`), so the demo's task and corpus stay as they were.

`build_task(seed)` returns the encyclopedia and three disjoint splits: SFT traces (the `<think>`, `<python>` /
`<search>`, `<result>`, `<answer>\\boxed{}` format of the tiny recipes), RL prompts and held-out questions. The
entities are partitioned between splits, so no held-out search question is about an entity seen in SFT or RL,
and no question text appears in two splits. The encyclopedia holds every entity (the search tool must find the
held-out ones too). `write_task(out_dir, seed)` writes `corpus.jsonl`, `sft.jsonl`, `rl.jsonl`, `heldout.jsonl`
and an eval registry `benchmarks.yaml` (benchmark `synthetic`) for `appo eval`.

How the traces teach copying (the skill the held-out split needs: its entities are never seen in training): the
name comes first, right after `<think>` and again right after `<search>`, as the numbers of a python question come
right after `print(`, and every search or both trace names it, a weak teacher's guess included. Before, the query
was `capital of Velmora`, named the entity once, and guesses not at all; copying then appeared abruptly late in
SFT, and whether it had by the end decided the demo's SFT start (34 % or 59 %, by seed or by CPU;
docs/benchmarks.md, "Demo"). `appo_trl.synthetic.copying` probes it; `tests/test_demo_cold_start.py` guards it.

Tool results inside the traces are the exact text the tools return through the rollout engine
(`RolloutConfig.result_template`, the search tool's `Page 1: ...` lines with `max_results: 1`), so SFT teaches
the same token sequences RL and evaluation later sample. This module does no I/O besides `write_task`, starts no
server and calls no tool.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

from appo_trl.synthetic import chains

SYSTEM_PROMPT = "Use <python> code </python> or <search> query </search>, then <answer> \\boxed{...} </answer>."
RESULT = " <result>\n{}\n</result>"  # appo_trl.rollout.types.RolloutConfig.result_template
# Names are two syllables, "Zor" + "vex" -> "Zorvex"; the demo tokenizer has each syllable as one token
# (`appo_trl.synthetic.pipeline.build_model`), so a name is always the same two tokens. None of them occurs inside
# the fixed words of the questions, traces and prompt (`test_demo_task.py` checks it).
HEADS = ["Zor", "Vex", "Kri", "Jun", "Qua", "Zel", "Vo", "Kip", "Jax", "Zu", "Yol", "Xan", "Kev", "Jor", "Vux", "Zim",
         "Kaz", "Yex", "Jil", "Vok"]  # fmt: skip
TAILS = ["zo", "vex", "kri", "jun", "qua", "zel", "vok", "kip", "jax", "zu", "yol", "xan", "kev", "jor", "vux", "zim",
         "kaz", "yex", "jil", "voz"]  # fmt: skip
SYLLABLES = HEADS + TAILS
OPS = ["+", "-", "*"]
# share of SFT traces that are a weak teacher's guesses (`guess_trace`); measured, 3 seeds: docs/benchmarks.md
GUESS_SHARE = 1 / 3
# digits of a python answer: those of the search and both answers (populations 100-999, times 2-9). With a 2-digit
# first number (11-99, before issue 49) most python answers had 2 digits, the only family with such answers, and
# the cold start copied a 2-digit result into `\\boxed{}` wrong in 92 % of its samples against 10 % for 3 and 4
# digits (first digit right, second not: `print(41 + 8 + 3)` prints 52, the box says 56); RL then turned guesses
# into python calls that landed on mis-copies, and the family fell (docs/benchmarks.md, "Demo", run F).
ANSWER_DIGITS = (3, 4)
# a both trace (and a guess at a both question) states its multiplier right after the entity, in `<think>`: "Velmora
# population, times 7: ...". Without it, the cold start copied the multiplier from the question into `print(P * k)`
# wrong for some seeds and kernels and not others (42 of 128 held-out samples, or 62, or none; docs/benchmarks.md,
# "Demo", run F): the copy spans the whole search result. The marker puts k next to the name the trace copies first.
MULTIPLIER_MARKER = ", times "
FAMILIES = ("python", "search", "both")
ALL_FAMILIES = (*FAMILIES, chains.FAMILY)
# share of the SFT chain traces that lose track after the first result (`chains.chain_question(wrong=True)`)
CHAIN_WRONG_SHARE = 0.3


@dataclasses.dataclass
class Entity:
    name: str
    capital: str
    population: int
    neighbour: str | None = None  # the chain family's link (another entity of the same split)


@dataclasses.dataclass
class Question:
    family: str
    question: str
    answer: str
    trace: str  # the assistant turn of an ideal solution, tool results included
    query: str = ""  # the trace's (first) search query, "Velmora capital" (none for python questions)
    named: str = ""  # what the trace's `<think>` names before its colon: the query, and a both question's multiplier

    def rl_row(self) -> dict:
        return {"prompt": self.question, "answer": self.answer, "family": self.family, "data_source": "synthetic"}

    def eval_row(self) -> dict:
        return {"question": self.question, "answer": [self.answer], "family": self.family}

    def sft_row(self) -> dict:
        return {"messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": self.question},
                             {"role": "assistant", "content": self.trace}]}  # fmt: skip


def make_entities(rng: random.Random, count: int) -> list[Entity]:
    """`count` entities with distinct names; capitals are other names (never an entity's, so a search for an
    entity cannot hit the document of a capital with the same name)."""
    names = [h + t for h in HEADS for t in TAILS]
    if count > len(names) - 20:
        raise ValueError(f"at most {len(names) - 20} entities (asked for {count})")
    rng.shuffle(names)
    cities = names[count:]
    return [Entity(n, rng.choice(cities), rng.randint(100, 999)) for n in names[:count]]


def corpus(entities: list[Entity]) -> list[dict]:
    """One short document per fact (`contents`, the retriever server's field)."""
    docs = []
    for e in entities:
        docs.append({"id": f"{e.name}-capital", "contents": chains.fact(e, "capital", e.capital)})
        docs.append({"id": f"{e.name}-population", "contents": chains.fact(e, "population", e.population)})
        if e.neighbour is not None:
            docs.append(chains.neighbour_doc(e))
    return docs


def search_result(doc: dict) -> str:
    """What the search tool shows for a top-1 hit (`appo_trl.tools.search.format_results`)."""
    return f"Page 1: {doc['contents']}"


def python_question(rng: random.Random) -> Question:
    """`a op b op c` with a of 3 digits and b, c of one, drawn again until the value has `ANSWER_DIGITS` digits."""
    while True:
        a, b, c = rng.randint(100, 999), rng.randint(2, 9), rng.randint(2, 9)
        op1, op2 = rng.choice(OPS), rng.choice(OPS)
        expr = f"{a} {op1} {b} {op2} {c}"
        value = str(eval(expr))  # noqa: S307 - our own three-number expression
        if len(value.lstrip("-")) in ANSWER_DIGITS:
            break
    trace = (f"<think>I will compute it with python.</think><python>print({expr})</python>{RESULT.format(value)}"
             f"<answer>\\boxed{{{value}}}</answer>")  # fmt: skip
    return Question("python", f"What is {expr}?", value, trace)


def search_question(rng: random.Random, e: Entity) -> Question:
    attr = rng.choice(("capital", "population"))
    value = str(getattr(e, attr))
    query = f"{e.name} {attr}"
    doc = {"contents": chains.fact(e, attr, value)}
    trace = (f"<think>{query}: I will search for it.</think><search>{query}</search>"
             f"{RESULT.format(search_result(doc))}<answer>\\boxed{{{value}}}</answer>")  # fmt: skip
    return Question("search", f"What is the {attr} of {e.name}?", value, trace, query, query)


def both_question(rng: random.Random, e: Entity) -> Question:
    k = rng.randint(2, 9)
    value = str(e.population * k)
    doc = {"contents": chains.fact(e, "population", e.population)}
    query = f"{e.name} population"
    named = f"{query}{MULTIPLIER_MARKER}{k}"
    trace = (f"<think>{named}: I will search, then compute.</think><search>{query}</search>"
             f"{RESULT.format(search_result(doc))}<python>print({e.population} * {k})</python>{RESULT.format(value)}"
             f"<answer>\\boxed{{{value}}}</answer>")  # fmt: skip
    return Question("both", f"What is the population of {e.name} times {k}?", value, trace, query, named)


@dataclasses.dataclass
class SyntheticTask:
    seed: int
    entities: list[Entity]
    sft: list[Question]
    rl: list[Question]
    heldout: list[Question]

    @property
    def corpus(self) -> list[dict]:
        return corpus(self.entities)


def _split(rng: random.Random, entities: list[Entity], count: int, seen: set[str],
           families: tuple[str, ...] = FAMILIES, wrong_chains: random.Random | None = None,
           wrong_share: float = 0.0) -> list[Question]:  # fmt: skip
    """`count` questions, families in turn (python, search, both[, chain]), search ones about `entities` only.

    `wrong_chains` (SFT only) draws which chain traces lose track (`wrong_share` of them).
    """
    out: list[Question] = []
    per_family = -(-count // len(families))
    if per_family > 2 * len(entities):  # 2 search questions and 8 multiplier questions per entity
        raise ValueError(f"{count} questions need more than {len(entities)} entities for this split")
    by_name = {e.name: e for e in entities}
    while len(out) < count:
        family = families[len(out) % len(families)]
        if family == "python":
            q = python_question(rng)
        elif family == "search":
            q = search_question(rng, rng.choice(entities))
        elif family == "both":
            q = both_question(rng, rng.choice(entities))
        else:
            wrong = wrong_chains is not None and wrong_chains.random() < wrong_share
            text, answer, trace, _ = chains.chain_question(rng, rng.choice(entities), by_name, RESULT.format,
                                                           wrong=wrong)  # fmt: skip
            q = Question(chains.FAMILY, text, answer, trace)
        if q.question not in seen:
            seen.add(q.question)
            out.append(q)
    return out


def guess_trace(rng: random.Random, q: Question, names: list[str]) -> str:
    """A weak teacher's trace for `q`: no tool call, a plausible answer that is always wrong (another name for a
    capital, a nearby number otherwise); like every trace, it names the entity and attribute it is asked about (and a
    both question's multiplier)."""
    if q.answer.lstrip("-").isdigit():
        v = int(q.answer)
        guess = str(v + rng.choice((-1, 1)) * rng.randint(1, max(2, abs(v) // 3)))
    else:
        guess = rng.choice([n for n in names if n != q.answer])  # (the capital itself is no guess)
    named = f"{q.named}: " if q.named else ""
    return f"<think>{named}I know it.</think><answer>\\boxed{{{guess}}}</answer>"


def build_task(seed: int = 0, *, num_sft: int = 96, num_rl: int = 256, num_heldout: int = 96,
               guess_share: float = GUESS_SHARE, families: tuple[str, ...] = FAMILIES,
               chain_wrong_share: float = CHAIN_WRONG_SHARE) -> SyntheticTask:  # fmt: skip
    """The encyclopedia and the three disjoint splits, all determined by `seed`.

    Each split gets its own entities (enough for its search questions: a third of the split, at most two per
    entity); python questions are fresh random expressions, kept unique across splits. A share `guess_share` of
    the SFT traces, drawn at random, are a weak teacher's guesses (`guess_trace`), so that the cold-started model
    answers some questions without its tools, as a model distilled from imperfect traces does, whatever its seed;
    RL has to learn that the tools pay. The RL and held-out splits are not affected.

    `families` picks the question families (in turn); with `chain`, each split's entities are linked into a
    neighbour cycle of their own (its own random stream, so the default families' task is unchanged) and a share
    `chain_wrong_share` of the SFT chain traces follow a wrong chain.
    """
    unknown = sorted(set(families) - set(ALL_FAMILIES))
    if unknown or not families:
        raise ValueError(f"unknown question families {unknown}; choose from {list(ALL_FAMILIES)}")
    if min(num_sft, num_rl, num_heldout) < 0:
        raise ValueError("split sizes must be >= 0")
    if not 0.0 <= guess_share < 1.0:
        raise ValueError(f"guess_share must be in [0, 1), got {guess_share}")
    rng = random.Random(seed)
    least = 3 if chains.FAMILY in families else 2  # a neighbour cycle needs 3 entities
    # at most 2 questions per entity and family (ceil(ceil(n / 3) / 2) = ceil(n / 6) for the default families)
    per_family = [-(-n // len(families)) for n in (num_sft, num_rl, num_heldout)]
    need = [max(least, -(-k // 2) + 1) for k in per_family]
    entities = make_entities(rng, sum(need))
    a, b = need[0], need[0] + need[1]
    seen: set[str] = set()
    wrong = None
    if chains.FAMILY in families:
        links = random.Random(seed + 104729)  # its own stream: the other families' questions do not change
        for part in (entities[:a], entities[a:b], entities[b:]):
            chains.link_neighbours(links, part)
        wrong = random.Random(seed + 15485863)
    sft = _split(rng, entities[:a], num_sft, seen, families, wrong, chain_wrong_share)
    rl = _split(rng, entities[a:b], num_rl, seen, families)
    heldout = _split(rng, entities[b:], num_heldout, seen, families)
    guesses = random.Random(seed + 7919)  # its own stream: the splits do not depend on guess_share
    capitals = [e.capital for e in entities]
    for q in sft:
        if guesses.random() < guess_share:
            q.trace = guess_trace(guesses, q, capitals)
    return SyntheticTask(seed, entities, sft, rl, heldout)


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def write_task(out_dir: str | Path, seed: int = 0, **sizes) -> dict[str, str]:
    """Write the task files into `out_dir`; returns their paths by name (corpus, sft, rl, heldout, registry)."""
    task = build_task(seed, **sizes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / f"{name}.jsonl" for name in ("corpus", "sft", "rl", "heldout")}
    _jsonl(paths["corpus"], task.corpus)
    _jsonl(paths["sft"], [q.sft_row() for q in task.sft])
    _jsonl(paths["rl"], [q.rl_row() for q in task.rl])
    _jsonl(paths["heldout"], [q.eval_row() for q in task.heldout])
    registry = {
        "tasks": {"qa": {"metric": "em", "pass_metric": "em", "tools": ["python", "search"]}},
        "benchmarks": {"synthetic": {"path": str(paths["heldout"].resolve()), "task": "qa", "prompt": SYSTEM_PROMPT}},
    }
    paths["registry"] = out / "benchmarks.yaml"
    paths["registry"].write_text(json.dumps(registry, indent=1), encoding="utf-8")  # JSON is valid YAML
    return {k: str(v) for k, v in paths.items()}
