"""How auto scores a measured configuration and picks one: the calibration's choice, and the same rule on
what auto's own runs have seen since (`Seen`)."""

from dataclasses import dataclass, field
from typing import Any, Optional

from ..options import PAPER_KNOBS
from .cost_model import Config, geometric_tokens

AR_MARGIN = 1.05  # speculation must measure this much faster than ar to be chosen (timings are noisy)


@dataclass
class Choice:
    """A concrete mode and knobs, and why they were chosen (goes into Stats)."""

    mode: str
    kappa: int = PAPER_KNOBS["kappa"]
    gamma: int = PAPER_KNOBS["gamma"]
    exit_layer: Optional[int] = None
    why: str = ""
    branches: Optional[int] = None  # mirror's branch budget B (None: every branch)


@dataclass
class Seen:
    """What auto's runs at one sampling setting showed, against the calibration: `expected_rate` re-scores
    the measured configurations with it."""

    alphas: dict[int, float]  # the calibration's α per γ (its greedy traces)
    window_ms: dict[int, float] = field(default_factory=dict)  # the draft's serial window per γ: a fallback's cost
    acceptance: float = 1.0  # α seen / the calibration's
    reuse: float = 1.0  # branch reuse seen / the reuse the table predicted for the configurations run
    tokens: int = 0  # draft tokens judged
    steps: int = 0  # Mirror-SD steps that reused a branch or fell back


def expected_rate(row: dict, seen: Optional[Seen] = None) -> float:
    """Tokens/s of a measured table row on what auto has seen (None: the calibration's text): its traces'
    tokens per step carried over to α·acceptance by the geometric model (ar: one token a step), its measured
    step time plus Eq. 10's serial window for each reuse lost (reuse·(1 − reuse factor) more fallbacks)."""
    tokens, step_ms = row["tokens_per_step"], row["measured_step_ms"]
    g = row["gamma"] if row["mode"] != "ar" else 0
    if g and seen is not None and seen.acceptance != 1.0:
        alpha = seen.alphas[g]
        tokens *= geometric_tokens(min(alpha * seen.acceptance, 0.99), g) / geometric_tokens(alpha, g)
    if row["mode"] == "mirror" and seen is not None and seen.reuse != 1.0:
        reuse = row.get("reuse") or 0.0
        step_ms += (reuse - min(1.0, reuse * seen.reuse)) * seen.window_ms.get(g, 0.0)
    return 1e3 * tokens / step_ms


def choose(table: list[dict], seen: Optional[Seen] = None,
           incumbent: Optional[dict] = None) -> tuple[dict, dict, str]:
    """(the confirmed row fastest on what auto has seen, the ar row, a note).

    A row replaces the `incumbent` (default ar) only if it is expected AR_MARGIN faster: timings are noisy,
    and a gain within noise is not worth leaving plain generation (or, when adapting, the tuned choice)."""
    rows = [r for r in table if r.get("confirmed") and r.get("measured_step_ms")]
    ar = next(r for r in rows if r["mode"] == "ar")
    keep = incumbent or ar
    best = max(rows, key=lambda r: expected_rate(r, seen))
    if best is not keep and expected_rate(best, seen) < AR_MARGIN * expected_rate(keep, seen):
        what = "ar" if keep is ar else "the tuned choice"
        return keep, ar, f"; nothing else {AR_MARGIN:.2f}x {what}, so {what}"
    return best, ar, ""


def row_config(row: dict) -> Config:
    """A table row's configuration (a row from before branch budgets has none: every branch)."""
    return Config(row["mode"], row["kappa"], row["gamma"], row["exit_layer"], branches=row.get("branches"))


def describe(c: Any) -> str:
    mirror = c.mode == "mirror"
    return Config(c.mode, c.kappa if mirror else None, c.gamma if c.mode != "ar" else None,
                  c.exit_layer if mirror else None,
                  branches=getattr(c, "branches", None) if mirror else None).name
