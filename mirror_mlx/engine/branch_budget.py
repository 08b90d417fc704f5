"""Mirror-SD's branch budget (docs/design.md §3, "Branch budget"): which of a step's κ(γ+1) branches the draft
rolls out.

Branch (r, c), the window after "the step ends at row r with correction c", scores P(the step ends at row r) ·
P(c | it ends there), both read off the early exit; the top B are rolled out, and with B = None those that pay
by the generation's own clocks (`RolloutCost`). The budget only chooses which windows are precomputed: every
committed token is still the target's own, so it cannot change the output; a correction whose branch was not
rolled out is a fallback.

The exit's probability of a drafted token is calibrated by one shift b in logit space, P(accepted) =
σ(logit p + b), moved after each verify by a logistic-fit step. A shift, not a factor: an early exit of a small
target may give the drafted tokens 1/V each yet see most accepted, and a shift carries its ranking of the
steps over to the acceptance measured; b settles within a few steps.
"""

from collections import deque
from dataclasses import dataclass, field
from math import exp, log
from statistics import median
from typing import Optional, Sequence


@dataclass
class ExitView:
    """What the early exit says at one step: the log-probs of each row's top-κ candidates (in rank order),
    and of each drafted token ŷ_{r+1} at row r (γ values)."""

    cand_logprobs: list[list[float]]
    drafted_logprobs: list[float]


def _logit(p: float) -> float:
    p = min(max(p, 1e-9), 1.0 - 1e-9)
    return log(p / (1.0 - p))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + exp(-x)) if x >= 0 else exp(x) / (1.0 + exp(x))


@dataclass
class Calibration:
    """Per-generation shift from the exit's probability of a drafted token to its chance of acceptance."""

    shift: float = 0.0
    accepted: int = 0  # drafted tokens judged and accepted, and judged in all (what the shift was fit to)
    judged: int = 0

    def accept(self, drafted_prob: float) -> float:
        """P(the target accepts a drafted token the exit gives `drafted_prob`)."""
        return _sigmoid(_logit(drafted_prob) + self.shift)

    def update(self, view: ExitView, accepted: int) -> None:
        """After a verify that accepted `accepted` of the window: the drafted tokens judged are the accepted
        ones and the first rejected one (none after it was judged). The rate keeps the step stable for long
        windows (the fit's curvature is at most a quarter per token)."""
        judged = [exp(lp) for lp in view.drafted_logprobs[: accepted + 1]]
        if not judged:
            return
        error = sum((i < accepted) - self.accept(p) for i, p in enumerate(judged))
        self.shift = min(30.0, max(-30.0, self.shift + min(1.0, 4.0 / len(judged)) * error))
        self.accepted += min(accepted, len(judged))
        self.judged += len(judged)


def branch_scores(window: Sequence[int], cand: list[list[int]], view: ExitView,
                  calibration: Optional[Calibration] = None) -> list[list[float]]:
    """score[r][i] = P(the step ends at row r) · P(cand[r][i] | it ends there), r = 0..γ."""
    gamma, calibration = len(window), calibration or Calibration()
    reach, out = 1.0, []
    for r, (ids, lps) in enumerate(zip(cand, view.cand_logprobs)):
        probs = [exp(lp) for lp in lps]
        if r < gamma:
            drafted = exp(view.drafted_logprobs[r])
            accept = calibration.accept(drafted)
            end, rest = reach * (1.0 - accept), max(1.0 - drafted, 1e-12)
            out.append([0.0 if v == window[r] else end * p / rest for v, p in zip(ids, probs)])
            reach *= accept
        else:
            out.append([reach * p for p in probs])
    return out


def pick(scores: list[list[float]], budget: Optional[int]) -> Optional[list[tuple[int, int]]]:
    """The top-`budget` branches (row, candidate index) by score, listed in (row, index) order; ties go to
    the earlier row, then the higher-ranked candidate. None (no budget, or one that covers every branch):
    every branch."""
    every = [(r, i) for r, row in enumerate(scores) for i in range(len(row))]
    if budget is None or budget >= len(every):
        return None
    best = sorted(every, key=lambda ri: (-scores[ri[0]][ri[1]], ri[0], ri[1]))[:budget]
    return sorted(best)


def stems(window: Sequence[int], cand: list[list[int]], picked: list[tuple[int, int]]) -> list[list[int]]:
    """The draft's stems for the picked branches: stem (r, i) = ŷ_1..ŷ_r + [cand[r][i]] (one spine)."""
    return [list(window[:r]) + [cand[r][i]] for r, i in picked]


def spread(cand: list[list[int]], picked: Optional[list[tuple[int, int]]],
           windows: Sequence[list[int]]) -> list[list[Optional[list[int]]]]:
    """The rolled-out windows laid out by (row, candidate), as `reuse_window` reads them: None where a
    branch was not rolled out. `windows` are in the order of `picked` (None: every branch, row by row)."""
    it = iter(windows)
    if picked is None:
        return [[next(it) for _ in row] for row in cand]
    out: list[list[Optional[list[int]]]] = [[None] * len(row) for row in cand]
    for (r, i), w in zip(picked, it):
        out[r][i] = w
    return out


RECENT = 9  # timings RolloutCost keeps of each kind: the median of the latest (a slow first step moves it little)


def _recent() -> deque:
    return deque(maxlen=RECENT)


@dataclass
class RolloutCost:
    """What the engine's clocks said of this generation's latest steps (seconds): a one-row window (a serial
    window), the branch rollouts by row count, and the target's suffix."""

    windows: deque = field(default_factory=_recent)
    rollouts: dict = field(default_factory=dict)
    suffixes: deque = field(default_factory=_recent)

    def saw_window(self, seconds: float) -> None:
        self.windows.append(seconds)

    def saw_step(self, rows: int, rollout: float, suffix: float) -> None:
        self.rollouts.setdefault(rows, _recent()).append(rollout)
        self.suffixes.append(suffix)

    def line(self) -> Optional[tuple[float, float]]:
        """(one row's rollout, each further row's), read off the fewest and most rows rolled out (branch
        rollouts only: a serial window feeds what a prepare fed); from one row count, all of it per row
        (the fixed part unknown: fewer rows are tried, and the next rollout tells). None before any."""
        points = {rows: median(times) for rows, times in self.rollouts.items()}
        if not points:
            return None
        lo, hi = min(points), max(points)
        if lo == hi:
            return points[hi] / hi, points[hi] / hi
        per_row = max(0.0, (points[hi] - points[lo]) / (hi - lo))
        return max(0.0, points[lo] - (lo - 1) * per_row), per_row

    def worth(self, scores: list[float]) -> int:
        """How many of the branches, best score first (`scores` sorted), to roll out: each that still ends
        within the suffix, and past it each whose score times a one-row window outweighs its row; all before
        any branch rollout was timed."""
        line = self.line()
        if line is None or not self.suffixes:
            return len(scores)
        one, per_row = line
        suffix = median(self.suffixes)
        window = median(self.windows) if self.windows else one  # what reusing a branch saves
        past = (k for k, score in enumerate(scores) if one + k * per_row > suffix and score * window < per_row)
        return max(next(past, len(scores)), 1)


@dataclass
class BranchBudget:
    """One generation's budget: B, its calibration and what its rollouts cost; `choose` runs on the target's
    thread at the early exit, `settle` after the verify."""

    budget: Optional[int]
    fit: bool = True  # with no B, fit the branches to what hides (`RolloutCost`); off: every branch
    calibration: Calibration = field(default_factory=Calibration)
    cost: RolloutCost = field(default_factory=RolloutCost)
    view: Optional[ExitView] = None
    picked: Optional[list[tuple[int, int]]] = None

    def choose(self, window: Sequence[int], cand: list[list[int]], view: ExitView) -> Optional[list[tuple[int, int]]]:
        self.view = view
        if self.budget is None and not self.fit:
            self.picked = None
            return None
        scores = branch_scores(window, cand, view, self.calibration)
        best = sorted(x for row in scores for x in row)[::-1]
        self.picked = pick(scores, self.budget if self.budget is not None else self.cost.worth(best))
        return self.picked

    def settle(self, accepted: int) -> None:
        if self.view is not None:
            self.calibration.update(self.view, accepted)
        self.view = None

    def rolled_out(self, cand: list[list[int]]) -> int:
        """Branches the last `choose` rolled out."""
        return sum(len(row) for row in cand) if self.picked is None else len(self.picked)
