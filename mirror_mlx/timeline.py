"""A generation's steps as a picture: one small record per step, which the chat page (`mirror-mlx serve`'s `/`)
streams and draws as the reply comes, and which `generate --timeline out.html` writes into one self-contained
file drawn by the same script. Times are the engine's own clocks (time.perf_counter, one clock for the target's
thread and the draft's process), in ms since the reply's first step began."""

import json
from html import escape
from pathlib import Path
from typing import Optional, Sequence

from .engine.stats import Stats, Step

PAGE = Path(__file__).parent / "page"  # the chat page's files: index.html, page.css, timeline.js, chat.js


def knobs(s: Stats) -> str:
    """The mode a step ran in and its knobs, as the summary line names them."""
    if s.mode == "mirror":
        line = f"mirror κ={s.kappa} γ={s.gamma} ℓe={s.exit_layer}" + (f" B={s.branches}" if s.branches else "")
    elif s.mode == "sd":
        line = "sd recycled tree" if s.recycle else f"sd γ={s.gamma}"
    else:
        line = s.mode
    return line + (" + lookup" if s.lookup and s.mode != "batch" else "")


class Steps:
    """One reply's step records, made as its steps come. The first step's start is the axis' zero; the mode,
    knobs and why are said in a record only when they change (a reader keeps the last said)."""

    def __init__(self) -> None:
        self.t0: Optional[float] = None
        self.said: tuple = ()
        self.count = 0

    def add(self, step: Step, ids: Sequence[int] = (), texts: Sequence[str] = (),
            drafted: Sequence[bool] = ()) -> dict:
        """`step` as drawn: its span and lanes, the tokens it committed (an end-of-sequence token too), what it
        offered and accepted, and the tokens it showed (`ids`, each one's text and whether the draft proposed it)."""
        if self.t0 is None:
            self.t0 = step.span[0]
        s, self.count = step.stats, self.count + 1
        out = {"n": self.count, **lanes(step, self.t0), "committed": len(step.tokens), "offered": step.offered,
               "accepted": step.accepted, "fallback": step.fallback,
               "tokens": [[t, int(d), i] for i, t, d in zip(ids, texts, drafted)]}
        if s.lookup_windows:
            out["lookup"] = True
        said = (s.mode, knobs(s), s.why)
        if said != self.said:
            self.said = said
            out.update(mode=s.mode, knobs=said[1], why=s.why)
        return out


def lanes(step: Step, t0: float) -> dict:
    """The step's span and its intervals in ms since t0: on the target's lane its prefix and suffix (mirror) or
    its one verify forward (`suffix` too); on the draft's lane the branch rollout beside the suffix and the
    serial windows the target waited for (mirror's first and fallback windows, sd's window)."""
    s, (start, end) = step.stats, step.span
    ms = lambda t: round(1000 * (t - t0), 3)  # noqa: E731
    out: dict = {"t": [ms(start), ms(end)], "serial": []}
    drawn = 0.0  # draft seconds placed by the engine's own clocks
    if s.timeline:  # mirror: every interval as the engine timed it
        t = s.timeline[-1]
        out["prefix"], out["suffix"] = [ms(x) for x in t["prefix"]], [ms(x) for x in t["suffix"]]
        r0, r1 = t["rollout"]
        if r1 > r0:
            out["rollout"], drawn = [ms(r0), ms(r1)], r1 - r0
        if "serial" in t:
            out["serial"].append([ms(t["serial"][0]), ms(t["serial"][1])])
            drawn += t["serial"][2]
    elif s.suffix_seconds:  # one forward, which ends the step
        out["suffix"] = [ms(end - s.suffix_seconds), ms(end)]
    first = s.draft_seconds - drawn  # a window rolled out before the target's forward: sd's, mirror's first
    if first > 1e-6:
        out["serial"].insert(0, [ms(start), ms(start + first)])
    return out


def html(records: list[dict], text: str, title: str, summary: str) -> str:
    """One self-contained HTML file of a run: its text with each step's tokens marked, its numbers and the
    timeline of all its steps, drawn by the chat page's own script (inlined: it opens offline)."""
    data = json.dumps({"steps": records, "text": text}).replace("</", "<\\/")
    css, script = (PAGE / "page.css").read_text(), (PAGE / "timeline.js").read_text()
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)}</title><style>{css}</style></head>
<body class="report"><main>
<h1>{escape(title)}</h1>
<p class="summary">{escape(summary)}</p>
<section class="picture" aria-label="the run's steps">
<div class="numbers" id="numbers"></div>
<div class="scroll"><svg id="timeline" role="img" aria-label="timeline of the run's steps"></svg></div>
<p class="legend" id="legend"></p>
</section>
<h2>Text</h2>
<div class="reply marked" id="text"></div>
</main>
<script type="application/json" id="run">{data}</script>
<script>{script}</script>
<script>MirrorTimeline.report(JSON.parse(document.getElementById("run").textContent));</script>
</body></html>
"""
