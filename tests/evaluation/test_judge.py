"""LLM judge against fake OpenAI-compatible servers: verdicts, retries, failures recorded, key handling."""

import json
import socket
import threading
import time

import httpx
import pytest

from appo_trl.evaluation.judge import JudgeConfig, LLMJudge, parse_verdict


def reply(content):
    return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": content}}]})


def make_judge(handler, **kw):
    cfg = JudgeConfig(
        base_url="http://judge.test/v1", model="judge-7b", backoff_s=0.0, api_key_env="APPO_TEST_JUDGE_KEY", **kw
    )
    return LLMJudge(cfg, transport=httpx.MockTransport(handler))


@pytest.mark.parametrize(
    "text,verdict",
    [("Correct", True), ("Incorrect", False), ("  correct.\n", True), ("The prediction is wrong", False),
     ("This is not correct", False), ("<judgment>Correct</judgment> because ...incorrect units aside", True),
     ("I am unsure", None), ("", None)],
)  # fmt: skip
def test_parse_verdict(text, verdict):
    assert parse_verdict(text) is verdict


def test_request_shape_prompt_and_key(monkeypatch):
    monkeypatch.setenv("APPO_TEST_JUDGE_KEY", "sk-secret")
    seen = []

    def handler(request):
        seen.append(request)
        return reply("Correct")

    out = make_judge(handler).judge([("Who?", ["Ada", "Ada Lovelace"], "Lovelace")])
    assert out == [{"correct": True, "reply": "Correct", "attempts": 1, "error": None}]
    req = seen[0]
    assert req.url.path == "/v1/chat/completions"
    assert req.headers["authorization"] == "Bearer sk-secret"
    body = json.loads(req.content)
    assert body["model"] == "judge-7b" and body["temperature"] == 0.0
    content = body["messages"][0]["content"]
    assert content.startswith("Given a Question and its Golden Answer")
    assert "Question: Who?\nGolden Answer: Ada / Ada Lovelace\nPredicted Answer: Lovelace" in content


def test_retries_then_success():
    calls = {"n": 0}

    def handler(request):
        calls["n"] += 1
        if calls["n"] == 1:
            return httpx.Response(500, text="boom")
        if calls["n"] == 2:
            return httpx.Response(200, text="not json")
        if calls["n"] == 3:
            return reply("Let me think about it")  # neither verdict
        return reply("Incorrect")

    out = make_judge(handler, max_retries=3).judge([("q", ["a"], "b")])
    assert out[0]["correct"] is False and out[0]["attempts"] == 4 and calls["n"] == 4


@pytest.mark.parametrize(
    "handler,error",
    [
        (lambda r: httpx.Response(500, text="boom"), "HTTP 500"),
        (lambda r: httpx.Response(200, json={"choices": []}), "malformed"),
        (lambda r: reply("maybe"), "unparseable"),
        (lambda r: (_ for _ in ()).throw(httpx.ReadTimeout("slow", request=r)), "ReadTimeout"),
    ],
)
def test_failures_are_recorded_not_raised(handler, error):
    counted = {"n": 0}

    def wrapped(request):
        counted["n"] += 1
        return handler(request)

    out = make_judge(wrapped, max_retries=2).judge([("q", ["a"], "b"), ("q2", ["c"], "d")])
    assert [o["correct"] for o in out] == [None, None]
    assert all(error in o["error"] for o in out)
    assert counted["n"] == 2 * 3  # first attempt + 2 retries, per item


def test_disabled_config_is_an_error():
    with pytest.raises(ValueError):
        LLMJudge(JudgeConfig())
    assert "OPENAI_API_KEY" == JudgeConfig().public()["api_key_env"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_http_server_with_timeout():
    """A FastAPI server on 127.0.0.1: the first request of each question hangs past the timeout."""
    import uvicorn
    from fastapi import FastAPI, Request

    app = FastAPI()
    seen: dict[str, int] = {}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        import asyncio

        body = await request.json()
        content = body["messages"][0]["content"]
        seen[content] = seen.get(content, 0) + 1
        if seen[content] == 1:
            await asyncio.sleep(2.0)  # past the client's 0.5 s timeout
        verdict = "Correct" if "Predicted Answer: Paris" in content else "Incorrect"
        return {"choices": [{"message": {"role": "assistant", "content": verdict}}]}

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(100):
            if server.started:
                break
            time.sleep(0.05)
        cfg = JudgeConfig(
            base_url=f"http://127.0.0.1:{port}/v1", model="m", timeout_s=0.5, backoff_s=0.0, max_retries=1
        )
        out = LLMJudge(cfg).judge(
            [("Capital of France?", ["Paris"], "Paris"), ("Capital of Peru?", ["Lima"], "Quito")]
        )
        assert [o["correct"] for o in out] == [True, False]
        assert [o["attempts"] for o in out] == [2, 2]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
