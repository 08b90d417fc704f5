"use strict";
// A reply's steps as a picture: the target's lane (its prefix up to the early exit, then its suffix; or its one
// verify forward) and the draft's lane (its branch rollout beside the suffix, and the serial windows the target
// waits for) on one time axis, each step's accepted tokens marked in the text. The chat page draws it live;
// `mirror-mlx generate --timeline` inlines this file into its report. Records: mirror_mlx/timeline.py.
(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const KINDS = [
    ["prefix", "target prefix (to the early exit)"],
    ["suffix", "target suffix, or its verify forward"],
    ["rollout", "draft rollout, beside the suffix"],
    ["serial", "draft window the target waits for"],
    ["batch", "batched forward (several requests)"],
  ];

  function el(name, attrs, parent, text) {
    const node = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }

  // What the steps add up to: tokens/s over their span, tokens per target forward (one per step; the server's
  // mean_accepted), fallbacks, and the mode, knobs and why last said.
  function numbers(steps) {
    const out = {steps: steps.length, tokens: 0, fallbacks: 0, offered: 0, accepted: 0, knobs: "", why: "", mode: ""};
    for (const s of steps) {
      out.tokens += s.committed;
      out.fallbacks += s.fallback ? 1 : 0;
      out.offered += s.offered;
      out.accepted += s.accepted;
      if (s.knobs !== undefined) { out.knobs = s.knobs; out.why = s.why || ""; out.mode = s.mode; }
    }
    const seconds = steps.length ? (steps[steps.length - 1].t[1] - steps[0].t[0]) / 1000 : 0;
    out.tps = seconds > 0 ? out.tokens / seconds : 0;
    out.perForward = steps.length ? out.tokens / steps.length : 0;
    return out;
  }

  function showNumbers(box, steps) {
    const n = numbers(steps);
    box.textContent = "";
    const items = [
      ["tokens/s", n.tps.toFixed(1)],
      ["accepted per forward", n.perForward.toFixed(2)],
      ["mode", n.knobs || "—"],
      ["fallbacks", `${n.fallbacks} of ${n.steps} steps`],
      ["draft tokens accepted", `${n.accepted} of ${n.offered}`],
    ];
    for (const [name, value] of items) {
      const item = document.createElement("div");
      if (name === "mode") item.className = "wide";
      const dt = document.createElement("dt");
      const dd = document.createElement("dd");
      dt.textContent = name;
      dd.textContent = value;
      item.append(dt, dd);
      box.appendChild(item);
    }
    return n;
  }

  function ticks(span, width) {
    const raw = span / Math.max(2, Math.floor(width / 90));
    const p = Math.pow(10, Math.floor(Math.log10(raw)));
    return [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw) || raw;
  }

  // Draw `steps` (the last `last` of them; 0: all) into `svg`, `width` px wide (default: its box's width).
  function draw(svg, steps, last, width) {
    const shown = last ? steps.slice(-last) : steps;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    width = Math.max(240, Math.round(width || svg.parentNode.clientWidth || 600));
    const left = 52, right = 12, top = 18, lane = 22, gap = 6;
    const height = top + 2 * lane + gap + 24;
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    svg.setAttribute("width", width);
    svg.setAttribute("height", height);
    svg.dataset.steps = shown.length;
    const laneY = [top, top + lane + gap];
    el("text", {x: 4, y: laneY[0] + 15, class: "lane"}, svg, "target");
    el("text", {x: 4, y: laneY[1] + 15, class: "lane"}, svg, "draft");
    if (!shown.length) {
      el("text", {x: left, y: laneY[0] + 15, class: "lane"}, svg, "no steps yet");
      return 0;
    }
    const t0 = shown[0].t[0], t1 = Math.max(shown[shown.length - 1].t[1], t0 + 1e-3);
    const x = (t) => left + ((t - t0) / (t1 - t0)) * (width - left - right);
    const bar = (iv, row, kind, s, name) => {
      const a = x(iv[0]), b = Math.max(x(iv[1]), a + 1);
      const r = el("rect", {x: a.toFixed(2), y: laneY[row] + 2, width: (b - a).toFixed(2), height: lane - 4,
                            rx: 2, class: `bar ${kind}`}, svg);
      el("title", {}, r, `step ${s.n}: ${name} ${(iv[1] - iv[0]).toFixed(2)} ms`);
      return 1;
    };
    let bars = 0;
    for (const s of shown) {
      const a = x(s.t[0]), b = x(s.t[1]);
      el("line", {x1: a, x2: a, y1: top - 4, y2: laneY[1] + lane, class: "step"}, svg);
      if (b - a >= 22) {
        const label = s.offered ? `${s.accepted}/${s.offered}` : `${s.committed}`;
        el("text", {x: (a + b) / 2, y: top - 5, class: "count" + (s.fallback ? " fallback" : ""),
                    "text-anchor": "middle"}, svg, label);
      }
      const batch = s.mode === "batch" || (s.mode === undefined && s.batch);
      if (s.prefix) bars += bar(s.prefix, 0, "prefix", s, "target prefix");
      if (s.suffix) bars += bar(s.suffix, 0, batch ? "batch" : "suffix", s, batch ? "batched forward" : "target suffix");
      if (s.rollout) bars += bar(s.rollout, 1, "rollout", s, "draft rollout");
      for (const w of s.serial || []) bars += bar(w, 1, "serial", s, "draft window (target waits)");
    }
    const axisY = laneY[1] + lane + 6, step = ticks(t1 - t0, width);
    el("line", {x1: left, x2: width - right, y1: axisY, y2: axisY, class: "axis"}, svg);
    for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step) {
      el("line", {x1: x(t), x2: x(t), y1: axisY, y2: axisY + 4, class: "axis"}, svg);
      const edge = x(t) > width - right - 24 ? "end" : "middle"; // (the last label stays inside)
      el("text", {x: edge === "end" ? width - 2 : x(t), y: axisY + 15, class: "tick", "text-anchor": edge}, svg,
         `${+t.toFixed(3)} ms`);
    }
    svg.setAttribute("aria-label", `timeline of ${shown.length} steps over ${(t1 - t0).toFixed(1)} ms: ` +
                     `${numbers(shown).accepted} draft tokens accepted`);
    return bars;
  }

  // `content` into `box`, each step's tokens in a span (alternating shades) and each token the draft proposed
  // and the target accepted marked; the box's text is `content` exactly (tokens that do not line up with it,
  // as after a stop string, are left unmarked).
  function mark(box, content, steps) {
    box.textContent = "";
    let pos = 0;
    for (const s of steps) {
      const group = document.createElement("span");
      group.className = "step" + (s.n % 2 ? "" : " odd") + (s.fallback ? " fallback" : "");
      for (const [text, drafted] of s.tokens) {
        if (!text || !content.startsWith(text, pos)) continue;
        const tok = document.createElement("span");
        tok.className = drafted ? "tok draft" : "tok own";
        tok.textContent = text;
        tok.title = `step ${s.n}: ` + (drafted ? "proposed by the draft, accepted" : "the target's own token");
        group.appendChild(tok);
        pos += text.length;
      }
      if (group.firstChild) box.appendChild(group);
    }
    if (pos < content.length) box.appendChild(document.createTextNode(content.slice(pos)));
  }

  // The colours' key: every kind, or (given steps) those they hold.
  function legend(box, steps) {
    const held = steps && new Set(steps.flatMap((s) => [s.prefix && "prefix", s.rollout && "rollout",
      s.serial && s.serial.length && "serial", s.suffix && (s.mode === "batch" ? "batch" : "suffix")]));
    box.textContent = "";
    for (const [kind, name] of KINDS) {
      if (held && !held.has(kind)) continue;
      const key = document.createElement("span");
      key.className = `key ${kind}`;
      key.setAttribute("aria-hidden", "true");
      box.append(key, ` ${name} `);
    }
    const d = document.createElement("span");
    d.className = "tok draft";
    d.textContent = "text";
    box.append(d, " accepted draft token; a/b above a step: draft tokens accepted of offered");
  }

  // `generate --timeline`'s file: the run's numbers, every step, the marked text.
  function report(run) {
    const box = document.getElementById("timeline");
    const wide = Math.max(box.parentNode.clientWidth, 28 * run.steps.length);
    showNumbers(document.getElementById("numbers"), run.steps);
    draw(box, run.steps, 0, wide);
    legend(document.getElementById("legend"), run.steps);
    mark(document.getElementById("text"), run.text, run.steps);
  }

  window.MirrorTimeline = {numbers, showNumbers, draw, mark, legend, report};
})();
