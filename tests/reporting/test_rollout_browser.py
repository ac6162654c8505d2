"""The rollout viewer in a real browser (Debian's chromium, driven by Playwright): pages made from a tiny ARPO run with
tree credit and from an agent run with chain rows show every dumped group and row with the dump's rewards and
advantages, selecting a row shows its text token by token, each token's colour is its `advantage_runs` value on the
page's scale, the console stays clean, and the screenshot is not blank.

Without chromium or playwright these tests skip with one line naming the package; under `CI=true` they fail instead.
"""

from __future__ import annotations

import importlib.util
import io
import math
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from appo_trl.reporting.rollout_page import write_page
from appo_trl.reporting.rollout_read import find_dump, read_step
from bench.rollout_viewer import CHROMIUM, CHROMIUM_ARGS

ROOT = Path(__file__).resolve().parents[2]


def require_browser(chromium: str = CHROMIUM) -> None:
    """Skip with one line naming the missing package; under `CI=true`, fail instead (CI must run these tests)."""
    missing = None
    if not Path(chromium).exists():
        missing = f"no browser at {chromium}: install Debian's `chromium` package (apt-get install -y chromium)"
    elif importlib.util.find_spec("playwright") is None:
        missing = "no `playwright` package: pip install -e '.[test]' (the browser is the system's chromium)"
    if missing and os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the browser tests: {missing}")
    if missing:
        pytest.skip(missing)


def test_a_missing_browser_skips_with_one_line_but_fails_under_ci(monkeypatch):
    def outcome():  # the skip or failure `require_browser` raises, caught here so this test itself never skips
        with pytest.raises(BaseException) as info:
            require_browser("/no/chromium")
        return info.type, str(info.value)

    monkeypatch.delenv("CI", raising=False)
    kind, text = outcome()
    assert kind is pytest.skip.Exception and "install Debian's `chromium` package" in text and "\n" not in text
    monkeypatch.setenv("CI", "true")
    kind, text = outcome()
    assert kind is pytest.fail.Exception and "CI must run the browser tests: no browser at /no/chromium" in text


@pytest.fixture(scope="module")
def browser():
    require_browser()
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="appo-test-chromium-")
    try:
        with sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                                        headless=True, viewport={"width": 1280, "height": 1000})  # fmt: skip
            yield ctx
            ctx.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def expand(runs, length):
    out = [None] * length
    for s, e, v in runs or []:
        out[s:e] = [v] * (e - s)
    return out


def colour(v, most):
    """The page's advantage colour (viewer.js `diverging`): green at or above 0, red below, alpha |v| / most."""
    a = math.floor(85 * min(1.0, abs(v) / most) + 0.5) / 100 if most > 0 else 0  # JS Math.round: halves up
    rgb = "22, 163, 74" if v >= 0 else "220, 38, 38"
    return f"rgba({rgb}, {a:g})" if a < 1 else f"rgb({rgb})"


def check_page(ctx, out: Path, tmp_path: Path) -> dict:
    """Open `appo rollouts OUT --html`'s page; check every step, group and row against the dump (module doc)."""
    page_file, _ = write_page(out, tmp_path / "page.html")
    page = ctx.new_page()
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(page_file.as_uri())
    page.wait_for_selector("section.group")
    dump = find_dump(out)
    seen = {"rows": 0, "tokens": 0, "chain": 0, "branched": 0, "masked": 0}
    for step in sorted(dump.steps):
        got = read_step(dump.steps[step])
        assert got.groups and not got.problems, got.problems
        page.select_option("#step-select", str(step))
        page.wait_for_function(f"document.querySelectorAll('section.group').length === {len(got.groups)} && "
                               f"document.getElementById('step-select').value === '{step}'")  # fmt: skip
        most = max(abs(v) for g in got.groups for r in g["rows"] for *_, v in r["advantage_runs"])
        for g in got.groups:
            sec = page.locator(f"section.group[data-group='{g['group']}']")
            assert sec.locator("tr[data-row]").count() == len(g["rows"])
            assert sec.locator("g.lane").count() == len(g["rows"])  # every row drawn in the tree
            for r in g["rows"]:
                tr = sec.locator(f"tr[data-row='{r['index']}']")
                assert float(tr.get_attribute("data-reward")) == pytest.approx(r["reward"])
                assert float(tr.get_attribute("data-advantage")) == pytest.approx(r["advantage"])
                tr.click()
                box = sec.locator(f".tokens[data-row='{r['index']}']")
                box.wait_for()
                shown = box.evaluate("""b => [...b.querySelectorAll('span.t')].map(s => [s.textContent,
                    s.dataset.v === undefined ? null : Number(s.dataset.v), getComputedStyle(s).backgroundColor,
                    s.classList.contains('m0')])""")  # fmt: skip
                assert "".join(t for t, *_ in shown) == "".join(r["tokens"])  # the row's text, token by token
                want = expand(r["advantage_runs"], r["length"])
                masked = [m for s, e, m in r["mask_runs"] for _ in range(s, e)]
                for t, (_, v, bg, m0) in enumerate(shown):
                    assert v == pytest.approx(want[t]) and bg == colour(want[t], most), (step, g["group"], r, t)
                    assert m0 == (masked[t] == 0)
                seen["rows"] += 1
                seen["tokens"] += len(shown)
                seen["masked"] += sum(m0 for *_, m0 in shown)
                seen["chain"] += r["role"] == "chain"
                seen["branched"] += r["parent"] is not None
    png = page.screenshot(full_page=True)
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    colours = image.getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 50 and max(n for n, _ in colours) < 0.97 * image.width * image.height, "blank screenshot"
    page.close()
    assert errors == [], errors
    return seen


@pytest.mark.slow
def test_arpo_run_with_tree_credit_in_the_browser(browser, tiny_sft_model_path, tmp_path):
    from appo_trl.cli import main

    out = tmp_path / "run"
    assert main(["train", "--config", str(ROOT / "recipes/tiny/arpo.yaml"), "--model_name_or_path",
                 tiny_sft_model_path, "--output_dir", str(out), "--dataset_name",
                 str(ROOT / "recipes/tiny/data/arith.jsonl"), "--save_strategy", "no", "--advantage_estimator", "tree",
                 "--dump_rollouts", "2", "--max_steps", "2", "--per_device_train_batch_size", "8"]) == 0  # fmt: skip
    seen = check_page(browser, out, tmp_path)
    assert seen["rows"] == 2 * 2 * 4 and seen["branched"] > 0 and seen["masked"] > 0, seen
    groups = [g for s in find_dump(out).steps.values() for g in read_step(s).groups]
    assert all(r["node_runs"] for g in groups for r in g["rows"])  # tree credit: node values on every row
    assert len({r["reward"] for g in groups for r in g["rows"]}) > 1  # the cold-started model's rows differ


@pytest.mark.slow
def test_agent_run_with_chain_rows_in_the_browser(browser, tiny_chat_model_path, tiny_chat_tokenizer, tmp_path):
    pytest.importorskip("openai")
    from tests.trainer.test_agent_chain_rows import RUNS, LoggedBackend, every_other_run_compacts
    from tests.trainer.test_agents import make_trainer

    RUNS.clear()
    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, every_other_run_compacts,
                              dump_rollouts=2, max_steps=1)  # fmt: skip
    trainer.rollout_engine.backend = LoggedBackend(tiny_chat_tokenizer)
    trainer.train()
    seen = check_page(browser, tmp_path, tmp_path)
    assert seen["chain"] > 0 and seen["masked"] > 0, seen
    [got] = [read_step(p) for p in find_dump(tmp_path).steps.values()]
    rows = [r for g in got.groups for r in g["rows"]]
    # the agent's calls: a run's from its messages, its other chain's from the chain's text
    assert all(len(r["tool_calls"]) == r["num_calls"] == 2 for r in rows), [(r["role"], r["num_calls"]) for r in rows]


def _open(ctx, url: str):
    page = ctx.new_page()
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    return page, errors


def test_policy_versions_are_one_more_colouring(browser, tmp_path):
    from tests.reporting.test_rollout_viewer import good, line, write_dump

    record = good(1)
    record["rows"][0]["version_runs"] = [[0, 5, 3], [5, 12, 4]]  # tokens 0-4 from policy 3, the rest from 4 (newest)
    out = write_dump(tmp_path / "run", {"step_000001.jsonl": line(record), "step_000002.jsonl": line(good(2))})
    page_file, _ = write_page(out, tmp_path / "page.html")
    page, errors = _open(browser, page_file.as_uri())
    page.wait_for_selector("section.group")
    options = lambda: page.eval_on_selector_all("#colouring option", "os => os.map(o => o.value)")  # noqa: E731
    assert options() == ["advantage", "node", "none"]  # step 2 (the newest): no row carries versions
    page.select_option("#step-select", "1")
    page.wait_for_function("document.querySelectorAll('#colouring option').length === 4")
    assert options() == ["advantage", "node", "version", "none"]
    page.select_option("#colouring", "version")
    page.wait_for_function("document.getElementById('legend').textContent.includes('one behind')")
    page.click("section.group tr[data-row='0']")
    box = page.locator(".tokens[data-row='0'][data-colouring='version']")
    box.wait_for()
    got = box.evaluate("b => [...b.querySelectorAll('span.t')].map(s => [Number(s.dataset.v), getComputedStyle(s)"
                       ".backgroundColor])")  # fmt: skip
    assert got == [[3, "rgb(253, 230, 138)"]] * 5 + [[4, "rgb(219, 234, 254)"]] * 7  # one behind: amber; newest: blue
    page.close()
    assert errors == []


def test_damaged_dumps_give_a_page_that_says_what_is_missing(browser, tmp_path):
    from tests.reporting.test_rollout_viewer import CASES, write_dump

    for case, (files, said, shown) in sorted(CASES.items()):
        out = write_dump(tmp_path / case, files)
        page_file, _ = write_page(out, tmp_path / f"{case}.html")
        page, errors = _open(browser, page_file.as_uri())
        page.wait_for_selector("section.group, p.empty")
        notes = page.inner_text("#notes")
        assert all(text in notes for text in said[:1]), (case, notes)
        assert page.locator("section.group").count() == shown, case
        if not shown:
            assert "no readable group" in page.inner_text("p.empty"), case
        page.close()
        assert errors == [], (case, errors)


def test_served_page_shows_a_step_dumped_after_it_opened(browser, tmp_path):
    import threading

    from appo_trl.reporting.rollout_page import make_server
    from tests.reporting.test_rollout_viewer import good, line, write_dump

    out = write_dump(tmp_path / "run", {"step_000001.jsonl": line(good(1))})
    server = make_server(out)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        page, errors = _open(browser, f"http://127.0.0.1:{server.server_address[1]}/")
        page.wait_for_selector("section.group")
        assert "(step 1," in page.inner_text(".prompt")
        (out / "rollouts" / "step_000002.jsonl").write_bytes(line(good(2)) + line(good(2, 1)))
        page.wait_for_function("document.querySelectorAll('#step-select option').length === 2 && "
                               "document.querySelectorAll('section.group').length === 2", timeout=60_000)  # fmt: skip
        assert "(step 2," in page.inner_text(".prompt") and page.input_value("#step-select") == "2"
        page.close()
        assert errors == []
    finally:
        server.shutdown()
        server.server_close()
