"""`bench --decompose`: the pieces of a step timed alone, after the run, and Eq. 10 built from them.

The run's own breakdown (summary.py) says where each measured step went, by the engine's clocks. This
says what the step should cost: each piece timed alone on the run's mean context (the first prompt and half
the tokens generated after it: attention grows with the context), in rounds
(tune's timed pieces, the same code the cost model is fed by), and the paper's step from them:

    mirror:  prefix(ℓe) + max(suffix(ℓe), late + rollout(rows)) + (1 − reuse) · window(γ),
             late = max(0, prepare(γ) − prefix(ℓe))   (the draft feeds the window during the prefix)
    sd:      window(γ) + verify(γ + 1)

with the run's own reuse rate. The measured step over it is what the step loses to contention between
the two sides, the ring, Python and scheduling. The draft's rollout at 1, 2, 4, 8 rows (after a prepare)
says how branches cost.
"""

from functools import partial
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from ..tune.timing import Bench
    from ..pipeline import Pipeline

from ..tune.timing import Bench, interleaved

ROLLOUT_ROWS = (1, 2, 4, 8)


def costs_alone(pipe: "Pipeline", context: list[int], points: dict, reps: int = 7) -> dict:
    """{"pieces": {name: ms}, "eq10": {mode: ms}, "rollout_rows": {rows: ms}} for the modes in `points`
    ({mode: dict(kappa, gamma, exit_layer, branches, reuse)}: mirror and sd as they ran)."""
    b = Bench(pipe, context)
    pieces: dict = {}
    mirror, sd = points.get("mirror"), points.get("sd")
    if mirror:
        g, e = mirror["gamma"], mirror["exit_layer"]
        rows = mirror["kappa"] * (g + 1) if mirror.get("branches") is None else mirror["branches"]
        pieces["split"] = partial(b.split, e, g + 1)
        pieces["prepare"] = partial(b.prepare, g)
        pieces["rollout"] = partial(b.rollout, _stems(b, rows, g), g)
        pieces["window"] = partial(b.rollout, [[b.context[-1]]], g)
    if sd:
        g = sd["gamma"]
        pieces["verify"] = partial(b.verify, g + 1)
        pieces["sd_window"] = partial(b.local_rollout, g) if pipe.engine.drafts_locally else partial(
            b.rollout, [[b.context[-1]]], g)
    g_rows = (mirror or sd or {}).get("gamma", 3)
    for n in ROLLOUT_ROWS:
        pieces[("rows", n)] = partial(b.rollout, _stems(b, n, g_rows), g_rows, True)
    t = interleaved(pieces, reps=reps, min_s=0.0)
    ms = {k: (tuple(1e3 * x for x in v) if isinstance(v, tuple) else 1e3 * v) for k, v in t.items()}
    out: dict = {"pieces": {}, "eq10": {}, "rollout_rows": {n: ms[("rows", n)] for n in ROLLOUT_ROWS}}
    if mirror:
        prefix, suffix = ms["split"]
        late = max(0.0, ms["prepare"] - prefix)
        out["pieces"].update(prefix=prefix, suffix=suffix, prepare=ms["prepare"], rollout=ms["rollout"],
                             window=ms["window"])
        out["eq10"]["mirror"] = prefix + max(suffix, late + ms["rollout"]) + (1 - mirror["reuse"]) * ms["window"]
    if sd:
        out["pieces"].update(verify=ms["verify"], sd_window=ms["sd_window"])
        out["eq10"]["sd"] = ms["sd_window"] + ms["verify"]
    return out


def _stems(b: "Bench", rows: int, gamma: int) -> list[list[int]]:
    """`rows` spine-shaped branches over the last γ context tokens, as a mirror step posts them."""
    kappa = -(-rows // (gamma + 1))
    stems = b.stems(kappa, gamma)
    order = sorted(range(len(stems)), key=lambda i: i % kappa)  # every row's first candidate first
    return [stems[i] for i in order[:rows]]


def points_ran(samples: list, summary: dict) -> dict:
    """The knobs mirror and sd ran with in the run (the last sample of each), and mirror's reuse rate."""
    out: dict = {}
    for s in samples:
        if s.mode in ("mirror", "sd") and s.stats.mode == s.mode:
            st = s.stats
            out[s.mode] = dict(kappa=st.kappa, gamma=st.gamma, exit_layer=st.exit_layer, branches=st.branches)
    if "mirror" in out:
        out["mirror"]["reuse"] = (summary.get("all", {}).get("mirror") or {}).get("reuse_rate") or 0.0
    return out


def table(report: dict) -> list[str]:
    """Markdown: each mode's measured step against Eq. 10 from the pieces timed alone, and the pieces."""
    d: Optional[dict] = report.get("decompose")
    if not d:
        return []
    rows = report["summary"]["all"]
    lines = ["| mode | measured step (ms) | Eq. 10 from pieces timed alone (ms) | step / Eq. 10 |",
             "|---|---:|---:|---:|"]
    for mode, ideal in d["eq10"].items():
        step = rows[mode]["ms_per_step"]
        lines.append(f"| {mode} | {step:.1f} | {ideal:.1f} | {step / ideal:.2f} |")
    pieces = ", ".join(f"{k} {v:.1f}" for k, v in d["pieces"].items())
    growth = ", ".join(f"{n} rows {v:.1f}" for n, v in d["rollout_rows"].items())
    return lines + ["", f"Pieces timed alone (ms): {pieces}. The draft's rollout after a prepare: {growth}."]
