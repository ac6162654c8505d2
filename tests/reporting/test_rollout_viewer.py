"""`appo rollouts`: damaged dumps get one line each (text view and --html), the page is self-contained, --serve shows
new steps and stops on Ctrl-C, the dump writer never leaves a cut file, and agent rows count their tool calls."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from appo_trl.cli import main
from appo_trl.reporting import atomic, rollout_dump
from appo_trl.reporting.rollout_page import build, make_server
from appo_trl.strategies import Round
from bench.rollout_viewer import synthetic_group

ROOT = Path(__file__).resolve().parents[2]


def good(step: int, g: int = 0) -> dict:
    return synthetic_group(random.Random(step * 10 + g), step, g, rows=4, tokens=12)


def write_dump(out: Path, files: dict[str, bytes]) -> Path:
    folder = out / "rollouts"
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return out


def line(record) -> bytes:
    return (json.dumps(record) + "\n").encode()


# name -> (files in rollouts/, the lines that must be said, groups shown of the newest step)
CASES = {
    "cut_newest": ({"step_000001.jsonl": line(good(1)), "step_000002.jsonl": line(good(2)) + line(good(2, 1))
                    + line(good(2, 2))[:57]}, ["step_000002.jsonl line 3 left out: cut mid-line after 57 bytes"], 2),
    "not_utf8": ({"step_000001.jsonl": line(good(1)) + b'{"rows": "\xff\xfe"}\n'},
                 ["step_000001.jsonl line 2 left out: not UTF-8 text (byte 0xff at column 11)"], 1),
    "random_bytes": ({"step_000001.jsonl": line(good(1)), "step_000002.jsonl": bytes(range(256)) * 3},
                     ["step_000002.jsonl left out: no line is a group record (4 problems; the first: line 1 left out: not "
                      "JSON"], 0),
    "final_and_folder": ({"step_000001.jsonl": line(good(1)), "step_final.jsonl": line(good(9))},
                         ["step_final.jsonl left out: not a step file"], 1),
    "hand_edited": ({"step_000001.jsonl": b"[1, 2]\n" + line({k: v for k, v in good(1).items() if k != "strategy"})
                     + line({**good(1, 1), "rows": [{**r, "reward": None} if r["index"] == 0 else r
                                                    for r in good(1, 1)["rows"]]})},
                    ["line 1 left out: a list, not a group record", "line 2: no `strategy`",
                     "line 3: row 0: `reward` is null"], 2),
    "older_dump": ({"step_000001.jsonl": line({**good(1), "rows": [{k: v for k, v in r.items() if k not in (
                    "advantage_runs", "tokens", "mask_runs")} for r in good(1)["rows"]]})},
                   ["4 row(s) without advantage_runs (a dump from an older appo-trl)"], 1),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_dumps_say_what_is_wrong_in_one_line_each(case, tmp_path, capsys):
    files, said, shown = CASES[case]
    out = write_dump(tmp_path / "run", files)
    if case == "final_and_folder":
        (out / "rollouts" / "step_000005.jsonl").mkdir()
        said = said + ["step_000005.jsonl left out: a folder, not a step file"]
    code = main(["rollouts", str(out), "--groups", "9"])
    got = capsys.readouterr()
    assert "Traceback" not in got.err + got.out
    assert code == (0 if shown else 2)
    err = got.err.splitlines()
    for text in said:
        assert sum(text in e for e in err) == 1, (text, err)
    assert all(e.startswith("appo rollouts: ") for e in err)
    assert len(re.findall(r"^group \d+ · ", got.out, re.M)) == shown
    assert bool(re.search(rf"· {shown}\s+group\(s\)\s+dumped", got.out)) == bool(shown)
    # the page: every readable group, every problem said on it, never blank
    assert main(["rollouts", str(out), "--html", str(tmp_path / "page.html")]) == 0
    page = (tmp_path / "page.html").read_text()
    for text in said[:1]:
        assert json.dumps(text)[1:-1].replace("<", "\\u003c") in page
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("case", ["missing", "not_a_folder", "no_rollouts", "empty_rollouts", "no_such_step"])
def test_nothing_to_show_is_one_line(case, tmp_path, capsys):
    out = tmp_path / "run"
    if case == "not_a_folder":
        out.write_text("x")
    elif case != "missing":
        out.mkdir()
    if case in ("empty_rollouts", "no_such_step"):
        (out / "rollouts").mkdir()
    if case == "no_such_step":
        (out / "rollouts" / "step_000001.jsonl").write_bytes(line(good(1)))
    want = {"missing": "does not exist", "not_a_folder": "is not a folder", "no_rollouts": "(no such folder)",
            "empty_rollouts": "--dump_rollouts 2", "no_such_step": "No rollouts for step 7"}[case]  # fmt: skip
    for extra in ([], ["--html", str(tmp_path / "p.html")]):
        assert main(["rollouts", str(out), "--step", "7", *extra]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and want in err[0] and err[0].startswith("appo rollouts: "), err
    assert not (tmp_path / "p.html").exists()
    if case == "missing":  # --serve too: one line, no server
        assert main(["rollouts", str(out), "--serve"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and want in err[0], err


def test_page_is_self_contained_and_embeds_the_dump(tmp_path):
    out = write_dump(tmp_path / "run", {f"step_{s:06d}.jsonl": line(good(s)) + line(good(s, 1)) for s in (1, 2, 3)})
    page = build(out)
    assert "<script src" not in page and "<link" not in page and "@import" not in page and "url(" not in page
    assert "fetch(" in page  # only in --serve mode (window.APPO_MODE.live); no other network
    assert page.count('<script type="application/json" id="appo-step-') == 3
    index = json.loads(page.split('id="appo-index">', 1)[1].split("</script>", 1)[0])
    assert [s["step"] for s in index["steps"]] == [1, 2, 3] and all(s["groups"] == 2 for s in index["steps"])
    rows = good(2)["rows"]
    assert index["steps"][1]["reward_mean"] == pytest.approx(
        sum(r["reward"] for g in (good(2), good(2, 1)) for r in g["rows"]) / 8
    )
    assert index["steps"][1]["branches"] == sum(
        r["parent"] is not None for g in (good(2), good(2, 1)) for r in g["rows"]
    )
    step2 = json.loads(page.split('id="appo-step-2">', 1)[1].split("</script>", 1)[0])
    assert [r["advantage_runs"] for r in step2["groups"][0]["rows"]] == [r["advantage_runs"] for r in rows]
    assert "/*@" not in page  # every slot of the template filled


def test_a_step_file_named_in_the_page_cannot_end_its_script(tmp_path):
    record = good(1)
    record["prompt"] = "</script><script>alert(1)</script><!--"
    page = build(write_dump(tmp_path / "run", {"step_000001.jsonl": line(record)}))
    data = page.split('id="appo-step-1">', 1)[1]
    assert data.index("</script>") > data.index("alert(1)")  # the prompt's tag is escaped; the block ends after it
    assert json.loads(data.split("</script>", 1)[0])["groups"][0]["prompt"] == record["prompt"]


def test_a_number_the_browser_cannot_parse_becomes_null(tmp_path):
    record = {**good(1), "answer": float("nan")}  # a hand-edited field the reader passes through
    page = build(write_dump(tmp_path / "run", {"step_000001.jsonl": line(record)}))
    data = page.split('id="appo-step-1">', 1)[1].split("</script>", 1)[0]
    assert "NaN" not in data and json.loads(data)["groups"][0]["answer"] is None


def _get(port: int, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.status, r.read()


def test_serve_shows_steps_dumped_after_it_started(tmp_path):
    out = write_dump(tmp_path / "run", {"step_000001.jsonl": line(good(1))})
    server = make_server(out)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        status, body = _get(port, "/")
        assert status == 200 and b'"live": true' in body and b'id="appo-step-' not in body
        assert [s["step"] for s in json.loads(_get(port, "/index.json")[1])["steps"]] == [1]
        (out / "rollouts" / "step_000002.jsonl").write_bytes(line(good(2)) + line(good(2, 1)))
        index = json.loads(_get(port, "/index.json")[1])
        assert [(s["step"], s["groups"]) for s in index["steps"]] == [(1, 1), (2, 2)]
        step = json.loads(_get(port, "/step/2.json")[1])
        assert [g["group"] for g in step["groups"]] == [0, 1]
        with open(out / "rollouts" / "step_000002.jsonl", "ab") as f:  # a later round of the same step
            f.write(line(good(2, 2)))
        assert [s["groups"] for s in json.loads(_get(port, "/index.json")[1])["steps"]] == [1, 3]
        assert [g["group"] for g in json.loads(_get(port, "/step/2.json")[1])["groups"]] == [0, 1, 2]
        with pytest.raises(urllib.error.HTTPError) as info:
            _get(port, "/step/9.json")
        assert info.value.code == 404 and "dumped steps: 1, 2" in info.value.read().decode()
    finally:
        server.shutdown()
        server.server_close()


def test_serve_prints_its_port_on_one_line_and_stops_on_ctrl_c(tmp_path):
    out = write_dump(tmp_path / "run", {"step_000001.jsonl": line(good(1))})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "appo_trl.cli", "rollouts", str(out), "--serve"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        first = proc.stdout.readline()
        assert first.startswith(f"appo rollouts: serving {out} at http://127.0.0.1:") and "Ctrl-C" in first
        port = int(first.split("127.0.0.1:", 1)[1].split("/", 1)[0])
        assert _get(port, "/index.json")[0] == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert proc.stderr.read().strip() == "appo rollouts: stopped" and proc.stdout.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- the writer -------------------------------------------------------------------------------------------------
class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _trainer(out, step=0, **args):
    return SimpleNamespace(args=SimpleNamespace(dump_rollouts=1, output_dir=str(out), rollout_strategy="grpo", **args),
                           accelerator=SimpleNamespace(is_main_process=True), state=SimpleNamespace(global_step=step),
                           processing_class_tokenizer=_Tok())  # fmt: skip


def _round(trajectory):
    batch = Round(groups=[[trajectory]], keep=[True])
    n = len(trajectory.completion_ids)
    out = {"advantages": torch.full((1, n), 0.25), "completion_mask": torch.ones(1, n)}
    return [{"prompt": "p", "answer": "a"}], batch, torch.ones(1), out


def _row(first=5, **kw):
    from appo_trl.rollout.types import Trajectory

    return Trajectory(prompt_ids=[1], completion_ids=[first, 7], loss_mask=[1, 1], logprobs=[0.0, 0.0], **kw)


def test_a_full_disk_leaves_the_step_file_as_it_was_and_says_so_in_one_line(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path)
    path = rollout_dump.dump_round(trainer, *_round(_row(11)))
    before = path.read_bytes()
    stale = path.parent / f".{path.name}.killed.tmp"  # what a SIGKILL mid-write leaves
    stale.write_text("x")
    real = os.fsync

    def full(fd):
        real(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full)
    with pytest.raises(rollout_dump.RolloutDumpError) as info:
        rollout_dump.dump_round(trainer, *_round(_row(22)))  # the same step again: appended, so the old text stays
    message = str(info.value)
    assert "No space left on device" in message and str(path) in message and "\n" not in message
    assert path.read_bytes() == before and sorted(p.name for p in path.parent.iterdir()) == [path.name]
    with pytest.raises(rollout_dump.RolloutDumpError):
        rollout_dump.dump_round(_trainer(tmp_path, step=1), *_round(_row(33)))  # a new step: no empty file
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_rollouts_path_that_is_a_file_or_takes_no_file_is_refused_before_the_model(
    tmp_path, monkeypatch, capsys, tiny_model_path
):
    from appo_trl.configs import preflight

    out = tmp_path / "run"
    out.mkdir()
    (out / "rollouts").write_text("not a folder")
    with pytest.raises(preflight.PreflightError, match=r"rollouts is a file, where the rollout dump's folder goes"):
        preflight.check_rollouts_dir(str(out), 2)
    preflight.check_rollouts_dir(str(out), 0)  # no dump: nothing to check
    (out / "rollouts").unlink()
    (out / "rollouts").mkdir()
    preflight.check_rollouts_dir(str(out), 2)

    def refuse(*a, **k):  # a read-only folder (root writes anywhere, so the refusal is the OS's answer, faked)
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(preflight.tempfile, "mkstemp", refuse)
    with pytest.raises(preflight.PreflightError, match="takes no new file: Permission denied"):
        preflight.check_rollouts_dir(str(out), 2)
    monkeypatch.undo()
    # `appo train` refuses it before the model loads
    (out / "rollouts").rmdir()
    (out / "rollouts").write_text("x")
    import appo_trl.trainer.trainer as trainer_module

    monkeypatch.setattr(trainer_module.APPOTrainer, "__init__", lambda *a, **k: pytest.fail("the model loaded"))
    code = main(["train", "--config", str(ROOT / "recipes/tiny/grpo.yaml"), "--model_name_or_path", tiny_model_path,
                 "--output_dir", str(out), "--dump_rollouts", "1"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "rollouts is a file, where the rollout dump's folder goes" in err[0], err


def test_token_texts_join_to_the_completion_and_keep_characters_whole(tiny_chat_tokenizer):
    tok = tiny_chat_tokenizer
    text = "Sum: 3 + 4 = 7 · café 漢字 🙂 <tool_call>\n{}\n</tool_call>"
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    pieces = rollout_dump.token_pieces(tok, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert any("🙂" in p for p in pieces) and "\ufffd" not in "".join(pieces)


def test_agent_rows_count_their_tool_calls_and_dump_their_other_chains(tmp_path):
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "tool", "tool_call_id": "c2", "content": "error: b missing"},
        {"role": "assistant", "content": "<answer>42</answer>"},
    ]  # fmt: skip
    chain = _row(9, origin="chain")
    chain.completion_ids = [8, 8]  # its text (the test tokenizer's "8 8" is no call): see the chat-format case below
    row = _row(5, messages=messages, chain_rows=[chain])
    trainer = _trainer(tmp_path)
    path = rollout_dump.dump_round(trainer, *_round(row))
    [record] = [json.loads(x) for x in path.read_text().splitlines()]
    run, other = record["rows"]
    assert run["num_calls"] == 2 and [c["tag"] for c in run["tool_calls"]] == ["multiply", "add"]
    assert run["tool_calls"][0]["result"] == "42" and run["tool_calls"][0]["ok"] is None
    assert (other["role"], other["run"], other["index"], other["parent"]) == ("chain", 0, 1, None)
    assert other["advantage_runs"] == [[0, 2, 0.25]] and other["reward"] == run["reward"] and other["kept"]
    from appo_trl.cli.rollouts import group_tree
    from tests.reporting.test_plot_and_rollouts import _render

    text = _render(group_tree(record, chars=0))
    assert "tools [multiply][add]" in text and "no tool calls" in text.split("#1")[1]  # the chain row made none
    assert "#1 chain of #0" in text
    text = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6}}\n</tool_call>\nuser\n<tool_response>\n42\n</tool_response>'
    assert rollout_dump.text_tool_calls(text) == [{"tag": "multiply", "query": '{"a": 6}', "ok": None, "result": "42"}]


def test_each_step_page_goes_to_the_trackers(tmp_path, monkeypatch):
    logged = []
    wandb = SimpleNamespace(run=object(), Html=lambda text, inject=True: ("wandb-html", text[:15]),
                            log=lambda data, commit=True: logged.append(("wandb", data, commit)))  # fmt: skip
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    run = SimpleNamespace(get=lambda: object())
    trackio = SimpleNamespace(context_vars=SimpleNamespace(current_run=run), Html=lambda text: ("trackio-html", text[:15]),
                              log=lambda data, step=None: logged.append(("trackio", data, step)))  # fmt: skip
    monkeypatch.setitem(sys.modules, "trackio", trackio)
    texts = []
    writer = SimpleNamespace(add_text=lambda tag, text, global_step: texts.append((tag, text, global_step)))
    trainer = _trainer(tmp_path, report_to=["wandb", "trackio", "tensorboard"])
    trainer.callback_handler = SimpleNamespace(callbacks=[SimpleNamespace(tb_writer=writer), object()])
    rollout_dump.dump_round(trainer, *_round(_row(5)))
    assert logged == [("wandb", {"rollouts/page": ("wandb-html", "<!doctype html>")}, False),
                      ("trackio", {"rollouts/page": ("trackio-html", "<!doctype html>")}, 1)]  # fmt: skip
    page = tmp_path / "rollouts" / "step_000001.html"
    assert page.is_file() and texts == [("rollouts/page", texts[0][1], 1)] and str(page) in texts[0][1]
    assert not list((tmp_path / "rollouts").glob(".*.tmp"))
