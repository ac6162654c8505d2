"""Agent runs that produce no row (issue 48, cause 7): an agent whose every request was refused is a failed run
named truly (reward 0, one warning), and an agent that never calls its base_url ends the stage in one line."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from tests.trainer.test_agents import make_trainer, silent_agent  # noqa: E402


def refused_agent(row, base_url, model):
    """Asks for what the endpoint does not serve (n=2), catches the 400 and scores itself 0."""
    client = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0)
    try:
        client.chat.completions.create(model=model, messages=list(row["prompt"]), n=2)
    except openai.BadRequestError:
        return 0.0
    finally:
        client.close()
    return 1.0


def test_an_agent_whose_every_request_was_refused_is_a_failed_run_named_truly(tmp_path, caplog, tiny_chat_tokenizer,
                                                                              tiny_chat_model_path):  # fmt: skip
    trainer, backend = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, refused_agent, max_steps=1)
    with caplog.at_level("WARNING"):
        trainer.train()  # before: ValueError "returned without calling its base_url" out of the round
    [log] = [h for h in trainer.state.log_history if "reward" in h]
    assert log["agent/errors"] == 4.0 and log["reward"] == 0.0
    assert backend.prompts == []  # nothing was sampled
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("agent 'refused_agent' failed: ")]
    assert len(warned) == 1, warned
    assert "refused all 1 of its requests, so it has no row (the first: HTTP 400: n: n=2 is not served" in warned[0]


def test_an_agent_that_never_calls_its_base_url_ends_the_stage_in_one_line(tmp_path, capsys, tiny_chat_tokenizer,
                                                                           tiny_chat_model_path):  # fmt: skip
    from appo_trl.stages.interrupts import run_interruptible

    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, silent_agent, max_steps=1)
    assert run_interruptible("appo train", str(tmp_path), trainer.train) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("appo train")]
    assert len(lines) == 1 and "returned without sending a single request to the base_url it was given" in lines[0]


def exiting_agent(row, base_url, model):
    import sys

    sys.exit(0)


def test_an_agent_that_calls_sys_exit_is_a_failed_run_not_a_hang(tmp_path, caplog, tiny_chat_tokenizer,
                                                                  tiny_chat_model_path):  # fmt: skip
    """Before: SystemExit reached the runner's event loop, stopped it, and the trainer waited forever."""
    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, exiting_agent, max_steps=1,
                              agent_timeout_s=60)  # fmt: skip
    with caplog.at_level("WARNING"):
        trainer.train()
    [log] = [h for h in trainer.state.log_history if "reward" in h]
    assert log["agent/errors"] == 4.0
    assert any("failed: RuntimeError: the agent raised sys.exit(0)" in r.getMessage() for r in caplog.records)
