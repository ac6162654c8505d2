"""The `chain` family: questions that need 3 to 5 dependent tool calls, where the path matters.

Every entity gets a neighbour (another entity of the same split, so nothing leaks between splits), and the
encyclopedia one more document per entity: "The neighbour of Velmora is Tarsk." A chain question can only be
answered by following the links, each call's input taken from an earlier result:

- 3 calls: "What is the population of the neighbour of Velmora times 4?"
  search `neighbour of Velmora` -> Tarsk; search `population of Tarsk` -> 412; `print(412 * 4)`.
- 4 calls: "What is the population of Velmora plus the population of the neighbour of Velmora?"
  search the neighbour, search both populations, then `print(a + b)`.
- 5 calls: "What is the population of the neighbour of the neighbour of Velmora minus the population of Velmora?"
  two neighbour hops, both populations, then `print(a - b)`.

Two wrong early steps are common in a cold-started model: skipping a hop (searching `population of Velmora` where
the question asks for its neighbour's) and, commonest in the study's cold start (docs/study.md, section 3.2),
copying a name from a tool result wrongly ("Junvux" becomes "Junjor"). Both are recoverable: after any wrong
search the model can still search the right entity and continue, which is what branching after a tool result
can find. A share `wrong_share` of the SFT chain traces follow such a wrong chain to the end (every call
well-formed, the last hop skipped, the answer wrong), as a teacher that loses track of the chain would, so the
cold start makes the mistake and RL has room to fix it.

Nothing here calls a tool or does I/O; `appo_trl.synthetic.task` draws the questions into its splits.
"""

from __future__ import annotations

import random

FAMILY = "chain"
CALLS = (3, 4, 5)  # calls a correct solution makes, one template each


def link_neighbours(rng: random.Random, entities: list) -> None:
    """Link the entities of one split into one random cycle: each has a neighbour in the same split, and with at
    least 3 entities the neighbour of a neighbour is never the entity itself."""
    if len(entities) < 3:
        raise ValueError(f"the chain family needs at least 3 entities per split, got {len(entities)}")
    order = list(entities)
    rng.shuffle(order)
    for i, e in enumerate(order):
        e.neighbour = order[(i + 1) % len(order)].name


def fact(e, attr: str, value) -> str:
    """The document text of one fact about entity `e` ("The population of Velmora is 412.").

    In a task with the chain family (`e.neighbour` set) every document starts with its entity's name as well:
    "Velmora: The neighbour of Velmora is Tarsk." The search tool ranks with BM25, a bag of words, so without
    it `neighbour of Velmora` scores Velmora's page and the page of the entity whose neighbour is Velmora ("The
    neighbour of Wyx is Velmora.") exactly the same, and the tie showed the wrong page for about half of all
    neighbour hops. Naming the entity twice puts its own page first for every `<attr> of <name>` query
    (`tests/test_chain_task.py` checks each one against the real index). The default task is unchanged.
    """
    text = f"The {attr} of {e.name} is {value}."
    return f"{e.name}: {text}" if e.neighbour is not None else text


def neighbour_doc(e) -> dict:
    return {"id": f"{e.name}-neighbour", "contents": fact(e, "neighbour", e.neighbour)}


def _search(query: str, contents: str, result) -> str:
    return f"<search>{query}</search>{result(f'Page 1: {contents}')}"


def _python(expr: str, value: str, result) -> str:
    return f"<python>print({expr})</python>{result(value)}"


def chain_question(rng: random.Random, e, by_name: dict, result, *, wrong: bool = False) -> tuple[str, str, str, int]:
    """(question, answer, trace, calls of the correct solution) of one chain question about entity `e`.

    `result(text)` renders a tool result exactly as the rollout engine does. With `wrong`, the trace loses track
    after the first result: it skips the last neighbour hop (3 and 4 calls: it searches the population of the
    entity itself; 5 calls: of the first neighbour) and boxes the number it computes from there.
    """
    calls = rng.choice(CALLS)
    hop1 = by_name[e.neighbour]
    hop2 = by_name[hop1.neighbour]
    pop = lambda x: _search(f"population of {x.name}", fact(x, "population", x.population), result)  # noqa: E731
    nb = lambda x, y: _search(f"neighbour of {x.name}", fact(x, "neighbour", y.name), result)  # noqa: E731
    if calls == 3:
        k = rng.randint(2, 9)
        question = f"What is the population of the neighbour of {e.name} times {k}?"
        answer = str(hop1.population * k)
        used = e if wrong else hop1
        steps, expr = [nb(e, hop1), pop(used)], f"{used.population} * {k}"
    elif calls == 4:
        question = f"What is the population of {e.name} plus the population of the neighbour of {e.name}?"
        answer = str(e.population + hop1.population)
        if wrong:
            steps, expr = [nb(e, hop1), pop(e)], f"{e.population} + {e.population}"
        else:
            steps, expr = [nb(e, hop1), pop(hop1), pop(e)], f"{e.population} + {hop1.population}"
    else:
        question = (f"What is the population of the neighbour of the neighbour of {e.name} minus the population "
                    f"of {e.name}?")  # fmt: skip
        answer = str(hop2.population - e.population)
        if wrong:
            steps, expr = [nb(e, hop1), pop(hop1), pop(e)], f"{hop1.population} - {e.population}"
        else:
            steps, expr = [nb(e, hop1), nb(hop1, hop2), pop(hop2), pop(e)], f"{hop2.population} - {e.population}"
    value = str(eval(expr))  # noqa: S307 - our own two-number expression
    think = "<think>I will follow the chain: search the neighbour, then the populations, then compute.</think>"
    trace = think + "".join(steps) + _python(expr, value, result) + f"<answer>\\boxed{{{value}}}</answer>"
    return question, answer, trace, calls
