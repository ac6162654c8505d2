"""The rollout viewer on a big dump: page size, build time, load time in headless Chromium, and whether scrolling stalls.

A synthetic dump shaped like the trainer's (`appo_trl.reporting.rollout_dump`: roots and rows branched from them at
token positions, tool calls with masked results, advantage and node-value runs) of STEPS x GROUPS x ROWS x TOKENS is
written to a temp folder, then `appo rollouts --html` builds the page (`rollout_page.write_page`). With Debian's
chromium (Playwright drives it) the page is loaded from disk: the time until the newest step's groups are drawn, the
time to open another step, to draw a row of TOKENS tokens, and the gaps between animation frames (median, p95, worst)
while the page and that row's text are scrolled, once the row is laid out (a stall shows as a long frame). It also times what
the dump costs the trainer per group: decoding each row's token texts with the tiny model's tokenizer.

    python bench/rollout_viewer.py              # 200 steps x 4 groups x 16 rows x 2,000 tokens (docs/benchmarks.md)
    python bench/rollout_viewer.py --quick --json

What this does not do: measure a real run's dump (its rows are the same shape; their texts differ).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

from appo_trl.algorithms.tree_credit import runs

WORDS = "the model adds three to seven and checks the sum before it answers with a number".split()
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


def synthetic_group(rng: random.Random, step: int, g: int, rows: int, tokens: int) -> dict:
    """One group record: rows // 4 roots, the rest branched from a root (or a branch) at a random token."""
    roots = max(1, rows // 4)
    out = []
    for i in range(rows):
        parent = None if i < roots else rng.randrange(i)
        bp = None if parent is None else rng.randrange(1, max(2, min(tokens, out[parent]["length"]) - 1))
        toks = list(out[parent]["tokens"][:bp]) if parent is not None else []
        mask = [m for s, e, m in out[parent]["mask_runs"] for _ in range(s, e)][:bp] if parent is not None else []
        spans = [sp for sp in out[parent]["tool_spans"] if sp[1] <= bp] if parent is not None else []
        while len(toks) < tokens:
            if rng.random() < 0.01 and len(toks) + 30 < tokens:  # a tool call, then its masked result
                call = ["<python>", " print", "(3", "+", "7", ")", "</python>"]
                toks += call
                mask += [1] * len(call)
                result = ["<result>", " 10", "</result>"]
                spans.append([len(toks), len(toks) + len(result)])
                toks += result
                mask += [0] * len(result)
            else:
                toks.append(" " + rng.choice(WORDS))
                mask.append(1)
        toks, mask = toks[:tokens], mask[:tokens]
        reward = float(rng.random() < 0.5)
        adv = [round(reward - 0.5 + (0.1 if t < (bp or 0) else 0.0), 4) for t in range(tokens)]
        node = [[s, e, round(rng.random(), 3), rng.randint(1, rows)] for s, e in _cuts(rng, bp or 0, tokens)]
        out.append({
            "index": i, "uid": f"{step}-{g}-{i}", "parent": parent, "origin": "root" if parent is None else "branch",
            "role": "row", "run": None, "branch_pos": bp, "fork_context": "".join(toks[max(0, (bp or 0) - 8) : bp or 0]),
            "reward": reward, "advantage": sum(adv) / len(adv), "kept": parent is None or rng.random() < 0.5,
            "num_calls": sum(1 for t in toks if t == "<python>"), "tool_calls": [],
            "finish_reason": rng.choice(["eos", "eos", "length", "call_limit"]), "length": tokens,
            "completion": "".join(toks)[:4000], "continuation": None, "tokens": toks, "mask_runs": runs(mask),
            "tool_spans": [sp for sp in spans if sp[1] <= tokens], "advantage_runs": runs(adv), "node_runs": node,
            "branch_entropy": None if parent is None else round(rng.random() * 3, 3),
            "branch_score": None if parent is None else round(rng.random(), 3), "version_runs": None,
        })  # fmt: skip
    return {"step": step, "group": g, "strategy": "appo", "prompt": f"what is 3 + 7? (step {step}, group {g})",
            "answer": "10", "rows": out}  # fmt: skip


def _cuts(rng, start, tokens):
    points = sorted({0, start, tokens, *(rng.randrange(1, tokens) for _ in range(2))} - {tokens}) + [tokens]
    return [(a, b) for a, b in zip(points, points[1:]) if b > a]


def synthetic_dump(output_dir: Path, steps: int, groups: int, rows: int, tokens: int, seed: int = 0) -> Path:
    """Write `output_dir/rollouts/step_<N>.jsonl` for steps 1..`steps`; returns `output_dir`."""
    rng = random.Random(seed)
    folder = output_dir / "rollouts"
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(1, steps + 1):
        lines = (json.dumps(synthetic_group(rng, s, g, rows, tokens)) for g in range(groups))
        (folder / f"step_{s:06d}.jsonl").write_text("\n".join(lines) + "\n")
    return output_dir


def browser_figures(page_file: Path, steps: int, tokens: int) -> dict:
    """Load, open-a-step, draw-a-row and scroll figures in headless Chromium (Playwright)."""
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="appo-bench-chromium-")
    try:
        with sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                                        headless=True)  # fmt: skip
            page = ctx.new_page()
            errors = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            t0 = time.perf_counter()
            page.goto(page_file.as_uri(), timeout=600_000)
            page.wait_for_selector("section.group", timeout=600_000)
            load_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            page.select_option("#step-select", "1")
            page.wait_for_function("document.querySelector('section.group h2') && "
                                   "document.querySelector('.prompt').textContent.includes('(step 1,')")  # fmt: skip
            step_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            page.click("section.group tr[data-row='0']")
            page.wait_for_selector(f".tokens span.t[data-t='{tokens - 1}']")
            row_s = time.perf_counter() - t0
            gaps = page.evaluate("""async () => {
                const box = document.querySelector('.tokens'), gaps = [];
                await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));  // the row laid out
                let last = performance.now();
                for (let i = 0; i < 240; i++) {
                    box.scrollTop += 40; window.scrollBy(0, i < 120 ? 25 : -25);
                    await new Promise(r => requestAnimationFrame(r));
                    const now = performance.now(); gaps.push(now - last); last = now;
                }
                return gaps.sort((a, b) => a - b); }""")
            ctx.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    return {"load_s": round(load_s, 3), "open_step_s": round(step_s, 3), "draw_row_s": round(row_s, 3),
            "scroll_frame_p50_ms": round(gaps[len(gaps) // 2], 1), "scroll_frame_p95_ms": round(gaps[int(len(gaps) * 0.95)], 1),
            "scroll_worst_frame_ms": round(gaps[-1], 1), "console_errors": len(errors)}  # fmt: skip


def writer_cost(work: Path, rows: int, tokens: int) -> float:
    """Seconds the trainer's dump spends decoding one group's token texts (`rollout_dump.token_pieces`), with the tiny
    model's byte-level BPE tokenizer on text of words, tool tags and a few characters of several bytes, median of 3."""
    from transformers import AutoTokenizer

    from appo_trl.reporting.rollout_dump import token_pieces
    from appo_trl.tiny import build_tiny_model

    tok = AutoTokenizer.from_pretrained(build_tiny_model(work / "tiny"))
    rng = random.Random(0)
    words = WORDS + ["<python>", "</python>", "3+7", "café", "→", "漢字"]  # a few characters of several bytes
    ids = []
    for _ in range(rows):
        row = tok.encode(" ".join(rng.choice(words) for _ in range(tokens)), add_special_tokens=False)
        ids.append(row[:tokens])
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for row in ids:
            token_pieces(tok, row)
        times.append(time.perf_counter() - t0)
    return sorted(times)[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small dump (6 steps x 2 groups x 4 rows x 200 tokens)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-browser", action="store_true", help="size and build time only")
    a = p.parse_args()
    from appo_trl.reporting.rollout_page import write_page

    shape = (6, 2, 4, 200) if a.quick else (200, 4, 16, 2000)
    work = Path(tempfile.mkdtemp(prefix="appo-bench-viewer-"))
    try:
        t0 = time.perf_counter()
        synthetic_dump(work / "run", *shape)
        dump_bytes = sum(f.stat().st_size for f in (work / "run" / "rollouts").iterdir())
        gen_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        page_file, size = write_page(work / "run", work / "page.html")
        build_s = time.perf_counter() - t0
        result = {"steps": shape[0], "groups": shape[1], "rows": shape[2], "tokens": shape[3],
                  "dump_mib": round(dump_bytes / 2**20, 1), "page_mib": round(size / 2**20, 1),
                  "generate_s": round(gen_s, 2), "build_s": round(build_s, 2),
                  "dump_token_texts_s_per_group": round(writer_cost(work, shape[2], shape[3]), 3)}  # fmt: skip
        if a.no_browser or not Path(CHROMIUM).exists():
            result["browser"] = (
                "skipped: no /usr/bin/chromium (apt-get install chromium)" if not a.no_browser else "off"
            )
        else:
            result.update(browser_figures(page_file, shape[0], shape[3]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>24}: {v}")


if __name__ == "__main__":
    main()
