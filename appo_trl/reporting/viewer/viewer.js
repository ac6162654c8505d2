// appo-trl's rollout viewer (appo_trl/reporting/rollout_page.py writes this page; docs/viewer.md describes it).
// Data: an index (one summary per step) parsed at load; a step's groups parsed, or fetched in --serve mode, only when
// the step is opened; a row's tokens drawn only when the row is selected. No network beyond the serving host.
(function () {
  "use strict";
  const MODE = window.APPO_MODE || { live: false, poll_s: 3 };
  const SVG = "http://www.w3.org/2000/svg";
  const steps = new Map(); // step -> payload
  const state = { step: null, colouring: "advantage", selected: new Map() }; // group -> row index
  let index = { steps: [], notes: [] };

  function el(tag, attrs, ...kids) {
    const e = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? "" : String(v));
    }
    for (const k of kids.flat()) if (k !== null && k !== undefined) e.append(k);
    return e;
  }
  const fmt = (x, d = 3) => (x === null || x === undefined ? "—" : (x >= 0 ? "+" : "") + Number(x).toFixed(d));
  const mean = (xs) => (xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null);
  const spread = (xs) => { const m = mean(xs); return xs.length > 1 ? Math.sqrt(mean(xs.map((x) => (x - m) ** 2))) : 0; };
  const ENDS = { eos: "answer", length: "length", call_limit: "tool limit", empty_call: "empty call", error: "error" };

  // ---- colourings: one function from a row to a per-token value, and one scale per step ------------------------
  function expand(runs, length, col = 2) {
    const out = new Array(length).fill(null);
    for (const r of runs || []) for (let t = r[0]; t < Math.min(r[1], length); t++) out[t] = r[col];
    return out;
  }
  const COLOURINGS = {
    advantage: { label: "advantage (advantage_runs)", values: (row) => row.advantage_runs && expand(row.advantage_runs, row.length) },
    node: { label: "node value V (tree credit)", values: (row) => row.node_runs && expand(row.node_runs, row.length) },
    version: { label: "policy version (version_runs)", values: (row) => row.version_runs && expand(row.version_runs, row.length), categorical: true },
    none: { label: "nothing", values: () => null },
  };
  function scaleOf(payload, name) {
    let most = 0;
    for (const g of payload.groups) for (const r of g.rows) for (const v of COLOURINGS[name].values(r) || []) if (v !== null) most = Math.max(most, Math.abs(v));
    return most;
  }
  // the colour of a value on a diverging scale: green above 0, red below, alpha |v| / most (two decimals, at most 0.85)
  function diverging(v, most) {
    if (v === null) return "";
    const a = most > 0 ? Math.round(85 * Math.min(1, Math.abs(v) / most)) / 100 : 0;
    return v >= 0 ? `rgba(22, 163, 74, ${a})` : `rgba(220, 38, 38, ${a})`;
  }
  const PALETTE = ["#dbeafe", "#fde68a", "#fbcfe8", "#bbf7d0", "#e9d5ff", "#fed7aa", "#a5f3fc", "#fecaca"];
  function tokenColour(v, most, name, newest) {
    if (name === "version") return v === null ? "" : PALETTE[Math.max(0, newest - v) % PALETTE.length];
    return diverging(v, most);
  }

  // ---- loading ----------------------------------------------------------------------------------------------------
  async function loadIndex() {
    if (MODE.live) {
      const r = await fetch("index.json", { cache: "no-store" });
      return r.json();
    }
    return JSON.parse(document.getElementById("appo-index").textContent);
  }
  async function loadStep(n) {
    if (steps.has(n) && !MODE.live) return steps.get(n);
    let payload;
    if (MODE.live) {
      const r = await fetch(`step/${n}.json`, { cache: "no-store" });
      payload = await r.json();
      if (!r.ok) payload = { step: n, groups: [], problems: [payload.error || `step ${n}: ${r.status}`] };
    } else {
      const node = document.getElementById(`appo-step-${n}`);
      payload = node ? JSON.parse(node.textContent) : { step: n, groups: [], problems: [`step ${n} is not in this page`] };
    }
    for (const g of payload.groups || []) unshare(g.rows);
    steps.set(n, payload);
    return payload;
  }
  // a branch's tokens before its fork are its parent's: the page carries them once (rollout_page.step_payload)
  function unshare(rows) {
    const byIndex = new Map(rows.map((r) => [r.index, r]));
    const whole = (r, depth = 0) => {
      if (!r.tokens_shared || depth > rows.length) return r.tokens;
      const p = byIndex.get(r.parent), head = p && whole(p, depth + 1);
      r.tokens = (head || []).slice(0, r.tokens_shared).concat(r.tokens || []);
      r.tokens_shared = 0;
      return r.tokens;
    };
    for (const r of rows) whole(r);
  }

  // ---- across steps -------------------------------------------------------------------------------------------------
  function plot(title, key, colour) {
    const W = 300, H = 130, L = 40, R = 10, T = 20, B = 22;
    const pts = index.steps.filter((s) => s[key] !== null && s[key] !== undefined);
    const svg = el("svg:svg", { width: W, height: H, class: "plot", "data-plot": key });
    svg.append(el("svg:text", { x: 8, y: 14, class: "title", text: title }));
    if (!pts.length) { svg.append(el("svg:text", { x: L, y: H / 2, text: "nothing dumped yet" })); return svg; }
    const xs = pts.map((s) => s.step), ys = pts.map((s) => s[key]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(0, ...ys), y1 = Math.max(...ys, y0 + 1e-9);
    const X = (x) => L + (x1 === x0 ? (W - L - R) / 2 : ((x - x0) / (x1 - x0)) * (W - L - R));
    const Y = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
    svg.append(el("svg:line", { x1: L, x2: W - R, y1: Y(y0), y2: Y(y0), stroke: "#d0d7de" }));
    svg.append(el("svg:text", { x: 4, y: Y(y1) + 4, text: Number(y1).toFixed(2) }), el("svg:text", { x: 4, y: Y(y0), text: Number(y0).toFixed(2) }));
    svg.append(el("svg:text", { x: L, y: H - 6, text: `step ${x0}` }), el("svg:text", { x: W - R - 50, y: H - 6, text: `step ${x1}` }));
    svg.append(el("svg:polyline", { points: pts.map((s) => `${X(s.step)},${Y(s[key])}`).join(" "), fill: "none", stroke: colour, "stroke-width": 1.5 }));
    for (const s of pts) {
      svg.append(el("svg:circle", { cx: X(s.step), cy: Y(s[key]), r: pts.length > 60 ? 2 : 3.5, fill: colour, class: s.step === state.step ? "current" : null,
        onclick: () => selectStep(s.step) }, el("svg:title", { text: `step ${s.step}: ${Number(s[key]).toFixed(3)}` })));
    }
    return svg;
  }
  function drawPlots() {
    const box = document.getElementById("plots");
    if (!box) return;
    box.replaceChildren(plot("reward (mean over dumped rows)", "reward_mean", "#1a7f37"),
      plot("branch rows per step", "branches", "#8250df"), plot("tool calls per row", "tool_calls", "#0969da"));
  }

  // ---- one group ----------------------------------------------------------------------------------------------------
  function kindOf(row) {
    if (row.role === "chain") return { k: "chain", text: `chain of #${row.run}` };
    if (row.origin === "restart") return { k: "restart", text: "restart" };
    if (row.parent === null) return { k: "root", text: row.origin === "refill" ? "refill" : "root" };
    return { k: row.origin === "fork" ? "fork" : "branch", text: `${row.origin} of #${row.parent} @ ${row.branch_pos}` };
  }
  function laneOrder(rows) {
    const kids = new Map(), order = [];
    for (const r of rows) if (r.parent !== null && r.role !== "chain") (kids.get(r.parent) || kids.set(r.parent, []).get(r.parent)).push(r);
    const visit = (r) => { order.push(r); for (const c of (kids.get(r.index) || []).sort((a, b) => (a.branch_pos || 0) - (b.branch_pos || 0))) visit(c);
      for (const c of rows.filter((x) => x.role === "chain" && x.run === r.index)) order.push(c); };
    for (const r of rows) if (r.parent === null && r.role !== "chain") visit(r);
    for (const r of rows) if (!order.includes(r)) order.push(r);
    return order;
  }
  function tree(group, select) {
    const rows = group.rows, order = laneOrder(rows), lane = new Map(order.map((r, i) => [r.index, i]));
    const W = 900, L = 70, R = 150, dy = 28, H = 18 + dy * order.length;
    const most = Math.max(1, ...rows.map((r) => r.length || 0));
    const X = (t) => L + (t / most) * (W - L - R), Y = (i) => 12 + i * dy;
    const rewards = rows.map((r) => r.reward).filter((x) => x !== null), rmost = Math.max(1e-9, ...rewards.map(Math.abs));
    const svg = el("svg:svg", { class: "tree", width: W, height: H, viewBox: `0 0 ${W} ${H}`, "data-group": group.group });
    order.forEach((row, i) => {
      const kind = kindOf(row), y = Y(i), start = row.parent !== null && row.role !== "chain" ? row.branch_pos || 0 : 0;
      const colour = { chain: "#bf8700", restart: "#cf222e", root: "#57606a" }[kind.k] || "#8250df";
      const g = el("svg:g", { class: "lane", "data-row": row.index, onclick: () => select(row.index) });
      g.append(el("svg:text", { x: 4, y: y + 4, class: "dim", text: `#${row.index} ${kind.k === "root" ? kind.text : kind.k}` }));
      if (row.parent !== null && lane.has(row.parent) && row.role !== "chain") {
        g.append(el("svg:line", { x1: X(start), x2: X(start), y1: Y(lane.get(row.parent)), y2: y, stroke: colour, "stroke-width": 1.2 }));
        const h = row.branch_entropy !== null ? ` H ${row.branch_entropy.toFixed(2)}` : "", s = row.branch_score !== null ? ` score ${row.branch_score.toFixed(2)}` : "";
        if (h || s) g.append(el("svg:text", { x: X(start) + 3, y: y + 14, class: "dim", text: (h + s).trim() }));
      }
      if (row.role === "chain" && lane.has(row.run)) g.append(el("svg:line", { x1: L - 6, x2: L - 6, y1: Y(lane.get(row.run)), y2: y, stroke: colour, "stroke-dasharray": "2 2" }));
      const nodes = (row.node_runs || []).filter((n) => n[1] > start);
      const segs = nodes.length ? nodes.map((n) => [Math.max(n[0], start), n[1], n[2], n[3]]) : [[start, row.length, null, null]];
      for (const [s, e, v, k] of segs) {
        const line = el("svg:line", { class: "seg", x1: X(s), x2: Math.max(X(e), X(s) + 1), y1: y, y2: y, stroke: colour, "stroke-width": 4,
          "stroke-dasharray": row.kept ? null : "5 3", "stroke-linecap": "butt" });
        if (v !== null) line.append(el("svg:title", { text: `tokens [${s}, ${e}): V ${fmt(v)} over ${k} row(s)` }));
        g.append(line);
        if (v !== null && X(e) - X(s) > 46) g.append(el("svg:text", { x: (X(s) + X(e)) / 2 - 18, y: y - 4, class: "dim", text: `V ${fmt(v, 2)}` }));
        if (v !== null) g.append(el("svg:line", { x1: X(e), x2: X(e), y1: y - 5, y2: y + 5, stroke: "#24292f" }));
      }
      if (row.origin === "restart") g.append(el("svg:rect", { x: X(start) - 4, y: y - 4, width: 8, height: 8, fill: colour }));
      const fill = row.reward === null ? "#afb8c1" : diverging(row.reward, rmost) || "#afb8c1";
      g.append(el("svg:circle", { cx: X(row.length), cy: y, r: 6, fill, stroke: "#24292f" }));
      g.append(el("svg:text", { x: X(row.length) + 10, y: y + 4, text: `${fmt(row.reward)}${row.kept ? "" : " (not in loss)"}` }));
      g.append(el("svg:title", { text: `#${row.index} ${kind.text}: reward ${fmt(row.reward)}, ${row.length} tokens${row.kept ? "" : ", not in the loss"}` }));
      svg.append(g);
    });
    return svg;
  }
  function rowTable(group, select) {
    const head = el("tr", {}, ["#", "kind", "reward", "advantage", "tool calls", "ended", "tokens", "loss", "branch H / score"].map((h) => el("th", { text: h })));
    const body = group.rows.map((row) => {
      const kind = kindOf(row), tags = (row.tool_calls || []).map((c) => `${c.tag}${c.ok === false ? "✗" : c.ok ? "✓" : ""}`).join(" ");
      const branch = [row.branch_entropy !== null ? row.branch_entropy.toFixed(2) : "", row.branch_score !== null ? row.branch_score.toFixed(2) : ""].filter(Boolean).join(" / ");
      return el("tr", { "data-row": row.index, "data-reward": row.reward, "data-advantage": row.advantage, "data-kept": row.kept, class: row.kept ? null : "out",
          onclick: () => select(row.index) },
        el("td", { text: row.index }), el("td", { class: `kind-${kind.k}`, text: kind.text }), el("td", { class: "num", text: fmt(row.reward) }),
        el("td", { class: "num", text: fmt(row.advantage) }), el("td", { text: `${row.num_calls}${tags ? " · " + tags : ""}` }),
        el("td", { text: ENDS[row.finish_reason] || row.finish_reason }), el("td", { class: "num", text: row.length }),
        el("td", { text: row.kept ? "in loss" : "not in loss" }), el("td", { text: branch }));
    });
    return el("table", { class: "rows" }, el("thead", {}, head), el("tbody", {}, body));
  }

  // ---- one row's text, token by token ------------------------------------------------------------------------------
  function markCalls(text, row) {
    // char ranges of sampled tool calls: <tool_call>...</tool_call> (chat tools) and <tag>...</tag> (tag tools)
    const tags = new Set(["tool_call", ...(row.tool_calls || []).map((c) => c.tag)]), ranges = [];
    for (const tag of tags) {
      const open = `<${tag}>`, close = `</${tag}>`;
      let at = 0;
      while ((at = text.indexOf(open, at)) >= 0) {
        const end = text.indexOf(close, at + open.length);
        ranges.push([at, end < 0 ? text.length : end + close.length]);
        at = end < 0 ? text.length : end + close.length;
      }
    }
    return ranges;
  }
  function detail(group, row, payload, box, select) {
    const name = state.colouring, values = COLOURINGS[name].values(row), most = scaleOf(payload, name);
    const newest = name === "version" ? Math.max(...(values || []).filter((v) => v !== null), 0) : 0;
    const kind = kindOf(row);
    const head = el("h3", { text: `#${row.index} ${kind.text} · reward ${fmt(row.reward)} · advantage ${fmt(row.advantage)} · ${ENDS[row.finish_reason] || row.finish_reason}, ${row.length} tokens${row.kept ? "" : " · not in the loss"}` });
    const calls = (row.tool_calls || []).map((c) => el("div", {}, `${c.tag} ${c.ok === false ? "failed" : c.ok ? "ok" : ""}: `, el("code", { text: c.query }), " → ", el("code", { text: c.result })));
    const out = el("div", { class: "tokens", "data-row": row.index, "data-colouring": name });
    if (!row.tokens) {
      out.append(el("div", { class: "calls", text: "This dump has no token texts (an older appo-trl): the text is shown whole, uncoloured." }), row.completion);
    } else {
      const mask = expand(row.mask_runs, row.length), res = new Array(row.length).fill(false);
      for (const [s, e] of row.tool_spans || []) for (let t = s; t < Math.min(e, row.length); t++) res[t] = true;
      const text = row.tokens.join(""), ranges = markCalls(text, row), call = new Array(row.tokens.length).fill(false);
      let c = 0;
      row.tokens.forEach((tok, t) => { const a = c, b = c + tok.length; c = b; call[t] = ranges.some(([s, e]) => a < e && b > s); });
      const forks = new Map(); // token position -> the rows that branch here
      for (const r of group.rows) if (r.parent === row.index && r.role !== "chain" && r.branch_pos !== null) (forks.get(r.branch_pos) || forks.set(r.branch_pos, []).get(r.branch_pos)).push(r);
      const nodes = row.node_runs ? expand(row.node_runs, row.length) : null, rowsThrough = row.node_runs ? expand(row.node_runs, row.length, 3) : null;
      const frag = document.createDocumentFragment();
      row.tokens.forEach((tok, t) => {
        if (row.parent !== null && row.role !== "chain" && t === row.branch_pos) frag.append(el("span", { class: "fork here", title: `#${row.index} leaves #${row.parent} here (token ${t})`, text: `↱ #${row.index} starts` }));
        for (const r of forks.get(t) || []) {
          const h = r.branch_entropy !== null ? `, entropy ${r.branch_entropy.toFixed(3)}` : "", s = r.branch_score !== null ? `, score ${r.branch_score.toFixed(3)}` : "";
          frag.append(el("span", { class: "fork", "data-fork": r.index, title: `#${r.index} branches here (token ${t}${h}${s}); click to open it`, text: `↱ #${r.index}${h ? " H " + r.branch_entropy.toFixed(2) : ""}`, onclick: (ev) => { ev.stopPropagation(); select(r.index); } }));
        }
        const v = values ? values[t] : null, cls = ["t"];
        if (mask[t] === 0) cls.push("m0");
        if (call[t]) cls.push("call");
        if (res[t]) cls.push("res");
        if (row.parent !== null && row.role !== "chain" && t < (row.branch_pos || 0)) cls.push("shared");
        const tip = [`token ${t}`, mask[t] === 0 ? "masked (not trained)" : "sampled", values ? `${name} ${v === null ? "—" : Number(v).toFixed(4)}` : "",
          nodes && nodes[t] !== null ? `V ${nodes[t].toFixed(3)} over ${rowsThrough[t]} row(s)` : ""].filter(Boolean).join(" · ");
        frag.append(el("span", { class: cls.join(" "), "data-t": t, "data-v": v === null ? null : v, style: v === null ? null : `background-color: ${tokenColour(v, most, name, newest)}`, title: tip, text: tok }));
      });
      if (row.tokens.length < row.length) frag.append(el("span", { class: "calls", text: ` … ${row.length - row.tokens.length} more tokens not dumped` }));
      out.append(frag);
    }
    box.replaceChildren(head, el("div", { class: "calls" }, calls.length ? calls : "no tool calls"), out);
  }

  function groupSection(group, payload) {
    const sec = el("section", { class: "group", "data-group": group.group });
    const rows = group.rows.filter((r) => r.role !== "chain"), rewards = rows.map((r) => r.reward).filter((x) => x !== null);
    const box = el("div", { class: "detail" });
    let svgTree = null, table = null;
    const select = (i) => {
      state.selected.set(group.group, i);
      for (const n of sec.querySelectorAll("[data-row].selected")) n.classList.remove("selected");
      for (const n of sec.querySelectorAll(`tr[data-row="${i}"], g.lane[data-row="${i}"]`)) n.classList.add("selected");
      const row = group.rows.find((r) => r.index === i);
      if (row) detail(group, row, payload, box, select);
    };
    const answer = group.answer === null || group.answer === undefined || group.answer === "" ? "" : ` · answer ${typeof group.answer === "string" ? group.answer : JSON.stringify(group.answer)}`;
    svgTree = tree(group, select);
    table = rowTable(group, select);
    const tools = rows.map((r) => r.num_calls), ends = {};
    for (const r of rows) ends[ENDS[r.finish_reason] || r.finish_reason] = (ends[ENDS[r.finish_reason] || r.finish_reason] || 0) + 1;
    sec.append(el("h2", { text: `group ${group.group} · ${group.strategy}${answer}` }), el("div", { class: "prompt", text: group.prompt }),
      el("div", { class: "stats" }, "reward mean ", el("b", { text: fmt(mean(rewards)) }), " · spread (std) ", el("b", { text: fmt(spread(rewards)).replace("+", "") }),
        ` · ${rows.length} rows, ${rows.filter((r) => r.parent !== null).length} branched, ${group.rows.length - rows.length} chain rows`,
        ` · tool calls per row ${tools.length ? mean(tools).toFixed(2) : "—"} · ended: ${Object.entries(ends).map(([k, n]) => `${k} ${n}`).join(", ")}`),
      svgTree, table, box);
    if (state.selected.has(group.group)) select(state.selected.get(group.group));
    return sec;
  }

  // ---- the page -----------------------------------------------------------------------------------------------------
  function notes(payload) {
    const items = [...(index.notes || []), ...((payload && payload.problems) || [])];
    document.getElementById("notes").replaceChildren(...(items.length ? [el("strong", { text: "Read with problems:" }), el("ul", {}, items.map((t) => el("li", { text: t })))] : []));
  }
  function legend() {
    const name = state.colouring, box = document.getElementById("legend");
    if (name === "none") return box.replaceChildren("");
    if (name === "version") return box.replaceChildren("newest", el("span", { class: "swatch", style: `background:${PALETTE[0]}` }), "one behind", el("span", { class: "swatch", style: `background:${PALETTE[1]}` }), "· dotted: masked (tool result) · underlined: tool call");
    box.replaceChildren("−", el("span", { class: "swatch", style: "background:linear-gradient(90deg, rgba(220,38,38,.85), rgba(220,38,38,0), rgba(22,163,74,0), rgba(22,163,74,.85))" }), "+ (scaled to the step's largest |value|) · dotted: masked (tool result) · underlined: tool call");
  }
  function colourings(payload) {
    const sel = document.getElementById("colouring"), has = (k) => payload.groups.some((g) => g.rows.some((r) => r[k]));
    const names = ["advantage", ...(has("node_runs") ? ["node"] : []), ...(has("version_runs") ? ["version"] : []), "none"];
    if (!names.includes(state.colouring)) state.colouring = "advantage";
    sel.replaceChildren(...names.map((n) => el("option", { value: n, text: COLOURINGS[n].label, selected: n === state.colouring })));
  }
  async function selectStep(n) {
    state.step = n;
    const sel = document.getElementById("step-select");
    sel.value = String(n);
    const payload = await loadStep(n);
    notes(payload);
    colourings(payload);
    legend();
    drawPlots();
    const body = document.getElementById("step");
    body.replaceChildren(...(payload.groups.length ? payload.groups.map((g) => groupSection(g, payload))
      : [el("p", { class: "empty", text: `Step ${n}: no readable group in ${payload.file || "its file"} (see the problems above).` })]));
  }
  function fillSteps() {
    const sel = document.getElementById("step-select");
    sel.replaceChildren(...index.steps.map((s) => el("option", { value: s.step, text: `${s.step} (${s.groups} group${s.groups === 1 ? "" : "s"})`, selected: s.step === state.step })));
  }
  async function start() {
    index = await loadIndex();
    const app = document.getElementById("app");
    if (!index.steps.length) {
      notes(null);
      app.replaceChildren(el("p", { class: "empty", text: MODE.live ? "No dumped step yet: this page shows them as the run writes them." : "This dump has no readable step (see above)." }));
      if (MODE.live) setTimeout(poll, MODE.poll_s * 1000);
      return;
    }
    app.replaceChildren(el("div", { class: "stats", text: `${index.dir} · ${index.steps.length} dumped step(s)` }), el("div", { id: "plots", class: "plots" }), el("div", { id: "step" }));
    fillSteps();
    document.getElementById("step-select").onchange = (e) => { document.getElementById("follow").checked = false; selectStep(Number(e.target.value)); };
    document.getElementById("colouring").onchange = (e) => { state.colouring = e.target.value; selectStep(state.step); };
    if (MODE.live) { document.getElementById("follow-label").hidden = false; setTimeout(poll, MODE.poll_s * 1000); }
    await selectStep(index.steps[index.steps.length - 1].step);
  }
  async function poll() {
    try {
      const fresh = await loadIndex(), key = (i) => JSON.stringify(i.steps);
      if (key(fresh) !== key(index)) {
        const first = !index.steps.length;
        const changed = new Set(fresh.steps.filter((s) => JSON.stringify(s) !== JSON.stringify(index.steps.find((o) => o.step === s.step))).map((s) => s.step));
        for (const n of changed) steps.delete(n);
        index = fresh;
        if (first) return start(); // start() polls on
        fillSteps();
        const newest = index.steps[index.steps.length - 1].step;
        if (document.getElementById("follow").checked) await selectStep(newest);
        else { drawPlots(); if (changed.has(state.step)) await selectStep(state.step); }
      }
    } catch (err) {
      document.getElementById("notes").replaceChildren(`The server does not answer (${err.message}); the page tries again.`);
    }
    setTimeout(poll, MODE.poll_s * 1000);
  }
  start().catch((err) => {
    document.getElementById("app").replaceChildren(el("p", { class: "empty", text: `This page could not draw the dump: ${err.message}` }));
  });
})();
