"""TRL's `examples/scripts/grpo_agent.py` (huggingface/trl): a SQL tool under a `signal.alarm` timeout (issue 34).

The reward functions, `TimeoutError`, `timeout`, `query_biogrid` and `format_example` are the example's,
unchanged. Changes, beside those of `tests/examples/harness.py`: the BioGRID database is a 3-row local table with
the example's column names in the test's temporary folder (the working directory, where the tool opens
`biogrid.db`), the questions are 2 local rows in the `qgallouedec/biogrid_qa` shape (`question`, `answer`), and
`chat_template_kwargs={"enable_thinking": False}` goes into the config as the script sets it, and
`max_completion_length=400`, `per_device_train_batch_size=8` (the tiny BPE spends many tokens on a SQL call). One question asks
about a missing column, so its SQL fails (an error result).
"""

from __future__ import annotations

import re
import signal
import sqlite3
import textwrap
from contextlib import contextmanager

import pytest
from datasets import Dataset

from tests.examples.harness import run, tool_stats
from tests.examples.scripted import call


def query_reward(completions, answer, **kwargs):
    """
    Reward query strategy:
    - Penalize more than 2 queries
    - Penalize generic queries (LIMIT 1 / PRAGMA)
    - Reward usage of WHERE
    - Reward evidence supporting the final answer
    """
    rewards = []

    for completion, ans in zip(completions, answer, strict=False):
        reward = 0.0
        sql_queries = []
        tool_results = []

        # collect all SQL queries and tool results
        for turn in completion:
            if turn.get("tool_calls"):
                for call in turn["tool_calls"]:
                    sql = call["function"]["arguments"].get("sql_command", "").lower()
                    sql_queries.append(sql)
            if turn.get("role") == "tool" and turn.get("content"):
                tool_results.append(turn["content"])

        # --- penalize too many queries ---
        if len(sql_queries) > 3:
            reward -= 1.5

        # --- check query quality ---
        where_count = 0
        for q in sql_queries:
            if "limit 1" in q:
                reward -= 1.0
            if " where " not in q:
                reward -= 0.5
            else:
                where_count += 1
        reward += min(where_count, 3) * 0.4  # small bonus for WHERE usage

        # --- evidence check: do queries support the answer? ---
        combined_results = []
        error_detected = False

        for res in tool_results:
            if isinstance(res, dict) and "error" in res:
                error_detected = True
            elif isinstance(res, list):
                combined_results.extend(res)

        # if error detected, penalize heavily
        if error_detected:
            reward -= 2.0
        elif len(sql_queries) == 0:
            reward -= 1.5
        else:
            has_hits = len(combined_results) > 0
            correct_answer = ans.lower()
            if (has_hits and correct_answer == "yes") or (not has_hits and correct_answer == "no"):
                reward += 2.0
            else:
                reward -= 1.5

        rewards.append(reward)

    return rewards


def correctness_reward(completions, answer, **kwargs):
    """
    Reward Yes/No correctness.
    Model must provide final answer enclosed in stars — *yes* or *no*.
    Does not reward informal yes/no buried in text.
    """
    rewards = []
    for completion, ans in zip(completions, answer, strict=False):
        raw = completion[-1]["content"].lower()

        # detect form *yes* or *no*
        match = re.search(r"\*(yes|no)\*", raw)
        guess = match.group(1) if match else None

        reward = 0.0

        if guess is None:
            reward -= 0.5  # invalid format
        elif guess == ans.lower():
            reward += 0.6  # correct under required format
        else:
            reward -= 1.0  # wrong answer

        rewards.append(reward)

    return rewards


def structure_reward(completions, **kwargs):
    """
    Reward proper assistant structure.
    Encourages a logical sequence: tool call + response + optional extra content.
    """
    rewards = []

    for completion in completions:
        has_call = False
        has_response = False
        has_other = False

        for turn in completion:
            role = turn.get("role")
            if role == "assistant" and turn.get("tool_calls"):
                has_call = True
            elif role == "tool":
                has_response = True
            else:
                content = turn.get("content")
                if content and content.strip() not in ["", "<think>"]:
                    has_other = True

        # Reward sequences
        if has_call and has_response:
            if has_other:
                reward = 0.1
            else:
                reward = 0.05  # still positive even without extra text
        elif has_call and not has_response:
            reward = -0.15
        else:
            reward = 0.0  # neutral if no call

        rewards.append(reward)

    return rewards


# ------------------------
# Database tool function
# ------------------------
class TimeoutError(Exception):
    """Raised when a function call times out."""

    pass


@contextmanager
def timeout(seconds):
    """Context manager that raises TimeoutError if execution exceeds time limit."""

    def timeout_handler(signum, frame):
        raise TimeoutError(f"Operation timed out after {seconds} seconds")

    signal.signal(signal.SIGALRM, timeout_handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)


def query_biogrid(sql_command: str) -> list[tuple]:
    """
    Execute a read-only SQL command on the BioGRID database.

    BioGRID is a curated biological database that compiles protein, genetic, and chemical interactions from multiple organisms. It provides researchers with experimentally verified interaction data to support studies in systems biology and functional genomics.

    Args:
        sql_command: The SQL command to execute.

    Returns:
        A list of tuples containing the query results.
    """
    with timeout(5):
        conn = sqlite3.connect("file:biogrid.db?mode=ro", uri=True)
        cursor = conn.cursor()
        try:
            cursor.execute(sql_command)
            results = cursor.fetchall()
        finally:
            conn.close()
    return results


# ------------------------
# Dataset formatting
# ------------------------
def format_example(example):
    question = example["question"]
    preamble = textwrap.dedent("""\
    You have access to the BioGRID SQLite database.
    Use SQL queries to retrieve only the information needed to answer the question.

    Genes may appear in the database in columns `Alt_IDs_Interactor_A` `Alt_IDs_Interactor_B`, `Aliases_Interactor_A` and `Aliases_Interactor_B`,
    and each entry can contain multiple gene names or synonyms separated by '|', for example:
    'entrez gene/locuslink:JNKK(gene name synonym)|entrez gene/locuslink:MAPKK4(gene name synonym)|...'
    So a gene like 'JNKK' or 'MAPKK4' may appear inside one of these strings.

    If the database schema is unclear or you are unsure about column names:
    - First inspect the schema with `PRAGMA table_info(interactions);`
    - Or preview a few rows with `SELECT * FROM interactions LIMIT 1;`

    Otherwise, directly query the required data.

    Final answer must be enclosed in stars, e.g. *Yes* or *No*.
    Facts:
    - The NCBI Taxonomy identifier for humans is taxid:9606.
    """)
    content = f"{preamble}\nQuestion: {question}"
    prompt = [{"role": "user", "content": content}]
    return {"prompt": prompt}


# ------------------------------------------------------------------ the test's own parts
COLUMNS = ["Alt_IDs_Interactor_A", "Alt_IDs_Interactor_B", "Aliases_Interactor_A", "Aliases_Interactor_B"]
QUESTIONS = {
    "Does the gene JNKK interact with MAPK8?": "yes",  # a WHERE query with a hit
    "Does the gene NOPE1 have a Taxid_Interactor_Z entry?": "no",  # a query on a missing column: SQL error
}


def turn(text: str, results: int) -> str:
    question = text.rsplit("Question: ", 1)[-1]
    if results:
        return "*yes*" if "JNKK" in question else "*no*"
    if "JNKK" in question:
        sql = "SELECT * FROM interactions WHERE Aliases_Interactor_A LIKE '%JNKK%'"
    else:
        sql = "SELECT Taxid_Interactor_Z FROM interactions WHERE Aliases_Interactor_A LIKE '%NOPE1%'"
    return call("query_biogrid", '{"sql_command": "' + sql + '"}')


@pytest.fixture
def biogrid(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    conn = sqlite3.connect("biogrid.db")
    conn.execute(f"CREATE TABLE interactions ({', '.join(c + ' TEXT' for c in COLUMNS)})")
    conn.executemany("INSERT INTO interactions VALUES (?, ?, ?, ?)", [
        ("entrez gene/locuslink:JNKK", "entrez gene/locuslink:MAPK8", "JNKK|MAPKK4", "MAPK8|JNK1"),
        ("entrez gene/locuslink:TP53", "entrez gene/locuslink:MDM2", "TP53|P53", "MDM2"),
        ("entrez gene/locuslink:BRCA1", "entrez gene/locuslink:BARD1", "BRCA1", "BARD1"),
    ])  # fmt: skip
    conn.commit()
    conn.close()
    data = Dataset.from_dict({"question": list(QUESTIONS), "answer": list(QUESTIONS.values())})
    return data.map(format_example, remove_columns=["question"])


def trainer_kw(dataset):
    return dict(train_dataset=dataset, tools=[query_biogrid],
                reward_funcs=[correctness_reward, structure_reward, query_reward])  # fmt: skip


CONFIG = dict(
    chat_template_kwargs={"enable_thinking": False}, per_device_train_batch_size=8, max_completion_length=400
)


def test_grpo_matches_trl_tool_calls(qwen3_tiny, tmp_path, biogrid):
    trl_run = run(qwen3_tiny, str(tmp_path / "trl"), turn, None, 1, CONFIG, **trainer_kw(biogrid))
    ours = run(qwen3_tiny, str(tmp_path / "grpo"), turn, "grpo", 1, CONFIG, **trainer_kw(biogrid))
    assert tool_stats(ours) == tool_stats(trl_run) == [(1.0, 0.5)]  # the missing column fails, the alarm works
    for key in ("rewards/correctness_reward/mean", "rewards/structure_reward/mean"):
        assert ours.state.log_history[0][key] == pytest.approx(trl_run.state.log_history[0][key]), key
    # TRL hands a tool's list result to the rewards as the list itself (`content = result if list else str`, meant
    # for multimodal blocks); APPO's tool messages hold the text the model read, so query_reward's evidence check
    # (`isinstance(res, list)`) sees no hits here: a known difference (docs/trl-parity.md)
    trl_query, our_query = (t.state.log_history[0]["rewards/query_reward/mean"] for t in (trl_run, ours))
    assert (round(trl_query, 2), round(our_query, 2)) == (2.4, 0.65)


@pytest.mark.parametrize("strategy", ["arpo", "aepo", "appo"])
def test_branching_strategies_train_two_steps(qwen3_tiny, tmp_path, biogrid, strategy):
    config = {**CONFIG, "per_device_train_batch_size": 4}  # one question per step
    trainer = run(qwen3_tiny, str(tmp_path / "out"), turn, strategy, 2, config, **trainer_kw(biogrid))
    assert sorted(f for _, f in tool_stats(trainer)) == [0.0, 1.0]  # the SIGALRM tool works; the bad SQL fails
    assert len(list((tmp_path / "out" / "completions").glob("*.parquet"))) == 2
