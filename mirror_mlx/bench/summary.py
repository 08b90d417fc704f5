"""Benchmark samples and their summaries: medians, pooled rates, the per-step latency breakdown, speedups."""

from collections import Counter
from dataclasses import dataclass
from statistics import median
from typing import Optional, Sequence

from .grid import point_name
from ..engine.stats import Stats


@dataclass
class Sample:
    """One generation: one prompt, one mode (or sweep point), and what it cost (the engine's `Stats`;
    for mlx-lm's baselines only tokens, seconds, forwards and memory are known)."""

    mode: str
    prompt: int
    category: str
    tokens: list[int]
    stats: Stats
    num_draft_tokens: Optional[int] = None
    ran_as: Optional[str] = None  # the engine's mode when it differs (a dropped draft runs as ar)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.stats.decode_seconds if self.stats.decode_seconds else 0.0


def rollout_seconds(timeline: list) -> float:
    """Mirror: time in branch rollouts (the rest of the draft time is serial: first and fallback windows)."""
    return sum(t["rollout"][1] - t["rollout"][0] for t in timeline)


def rollout_wait_seconds(timeline: list) -> float:
    """Mirror: how long the target waited for branch rollouts that outlasted its suffix."""
    return sum(max(0.0, t["rollout"][1] - max(t["rollout"][0], t["suffix"][1])) for t in timeline)


def ring_wait_seconds(timeline: list) -> float:
    """Mirror: how long the target waited for branch windows beyond the draft's own work: the answer's way
    over the ring and the scheduler's wake-up (arrival minus the later of the rollout's end and the suffix's)."""
    return sum(max(0.0, t.get("arrived", t["suffix"][1]) - max(t["rollout"][1], t["suffix"][1])) for t in timeline)


def serial_seconds(timeline: list) -> tuple[float, float]:
    """Mirror: (the draft's own time, the rest: ring and scheduling) of the serial windows after fallbacks,
    as the engine waited for them."""
    serial = [t["serial"] for t in timeline if "serial" in t]
    draft = sum(s[2] for s in serial)
    return draft, sum(s[1] - s[0] for s in serial) - draft


def ideal_step_seconds(timeline: list) -> float:
    """Mirror: the paper's step, prefix + max(suffix, rollout), summed over the steps as measured (Eq. 10's
    overlap with nothing lost: the target never waits past the longer of the two)."""
    dur = lambda iv: iv[1] - iv[0]  # noqa: E731
    return sum(dur(t["prefix"]) + max(dur(t["suffix"]), dur(t["rollout"])) for t in timeline)


def summarize(samples: Sequence[Sample]) -> dict:
    """Median tokens/s; pooled rates (sums over prompts) and the per-step latency breakdown in ms."""
    n_tok = sum(len(s.tokens) for s in samples)
    tot = sum((s.stats for s in samples), Stats())
    decode, prefix, suffix = tot.decode_seconds, tot.prefix_seconds, tot.suffix_seconds
    draft, hidden = tot.draft_seconds, tot.hidden_draft_seconds
    per = 1000.0 / max(tot.steps, 1)
    out: dict[str, object] = {
        "prompts": len(samples), "tokens": n_tok, "tokens_per_s": median(s.tokens_per_s for s in samples),
        "mean_accepted": n_tok / max(tot.target_forwards, 1), "ms_per_step": decode * per,
        "peak_memory_gb": tot.peak_memory_gb,
        "fallback_rate": None, "reuse_rate": None, "omega_kappa": None, "hidden_draft_fraction": None}
    if suffix:  # the engine's modes: the critical path of a step, in order; hidden draft time runs beside the suffix
        wait, ring = rollout_wait_seconds(tot.timeline), ring_wait_seconds(tot.timeline)
        serial = draft - rollout_seconds(tot.timeline)  # (sd: its windows; mirror: the first and fallback windows)
        ring += serial_seconds(tot.timeline)[1]
        breakdown = {"prefix": prefix * per, "suffix": suffix * per, "rollout_wait": wait * per,
                     "draft": serial * per, "ring": ring * per,
                     "overhead": max(0.0, decode - prefix - suffix - wait - serial - ring) * per,
                     "draft_hidden": hidden * per}
        if tot.timeline:  # Eq. 10: the ideal step plus the fallback windows, which no overlap can hide
            breakdown["ideal"] = (ideal_step_seconds(tot.timeline) + serial) * per
    else:  # mlx-lm's loops: one number per step, not split
        breakdown = {"unsplit": decode * per}
    out["breakdown_ms"] = breakdown
    if prefix:  # mirror: only it has a target prefix
        out.update(fallback_rate=tot.fallback_rate, reuse_rate=tot.reuse_rate, omega_kappa=tot.omega_kappa,
                   hidden_draft_fraction=tot.hidden_draft_fraction)
    k = {s.num_draft_tokens for s in samples if s.num_draft_tokens}
    if k:
        out["num_draft_tokens"] = sorted(k)
    ran = Counter(s.ran_as for s in samples if s.ran_as)
    if ran:  # how often each, when the mode ran as more than one thing
        out["ran_as"] = [f"{k} ×{n}" if len(ran) > 1 else k for k, n in ran.most_common()]
    return out


def table(samples: Sequence[Sample], keys: Sequence[str]) -> dict:
    """{category: {key: summary}} with an `all` category first; speedups against `ar` and `mlx_sd`."""
    cats = ["all"] + sorted({s.category for s in samples})
    if len(cats) == 2:
        cats = ["all"]
    out: dict = {}
    for cat in cats:
        rows = {}
        for key in keys:
            group = [s for s in samples if s.mode == key and (cat == "all" or s.category == cat)]
            if group:
                rows[key] = summarize(group)
        for key, row in rows.items():
            for base in ("ar", "mlx_sd"):
                b = rows.get(base)
                row[f"speedup_vs_{base}"] = row["tokens_per_s"] / b["tokens_per_s"] if b and b["tokens_per_s"] else None
                row[f"paired_speedup_vs_{base}"] = paired_speedup(
                    [s for s in samples if cat == "all" or s.category == cat], key, base) if b else None
        out[cat] = rows
    return out


def paired_speedup(samples: Sequence[Sample], key: str, base: str) -> Optional[float]:
    """Median over prompts of key's tokens/s ÷ base's on the same prompt (run next to it, so drift cancels)."""
    def per_prompt(mode: str) -> dict[int, float]:
        runs: dict[int, list[float]] = {}
        for s in samples:
            if s.mode == mode:
                runs.setdefault(s.prompt, []).append(s.tokens_per_s)
        return {p: sum(v) / len(v) for p, v in runs.items()}

    a, b = per_prompt(key), per_prompt(base)
    ratios = [a[p] / b[p] for p in a if b.get(p)]
    return median(ratios) if ratios else None


def best_point(rows: dict, points: Sequence[dict]) -> dict:
    """The sweep point with the highest median tokens/s (its knobs and its row)."""
    pt = max(points, key=lambda pt: rows[point_name(pt)]["tokens_per_s"])
    return dict(pt, name=point_name(pt), **{k: rows[point_name(pt)][k] for k in ("tokens_per_s", "speedup_vs_ar")})
