"""The paper's latency model (Eq. 10, docs/design.md §2) for `mirror`, `sd` and `ar`, fed only by measurements.

Beyond the design doc's formulas: T_late = max(0, T_prepare(γ) − T_prefix) delays the rollout inside T_par (the
draft feeds the window during the prefix), and a branch budget B rolls out min(B, κ(γ+1)) rows, timed between
the row counts measured, with the contention measured at κ(γ+1). Tokens per step and reuse are replayed from
acceptance traces (`Trace`), so they are measured, not assumed; under a budget the engine picks its B per step
from the exit's own probabilities (branch_budget.py), so it can only do better on text like the traces'.
"""

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Iterable, Optional, Union

from ..options import PAPER_KNOBS

if TYPE_CHECKING:
    from .profile import Profile
    from ..engine.stats import Stats


@dataclass(frozen=True)
class Config:
    """One point of the grid; knobs a mode does not use are None."""

    mode: str
    kappa: Optional[int] = None
    gamma: Optional[int] = None
    exit_layer: Optional[int] = None
    placement: str = "unpinned"  # where its threads run (tune/placement.py); only mirror is measured split
    branches: Optional[int] = None  # mirror's branch budget B (None: every branch)

    @property
    def name(self) -> str:
        if self.mode == "ar":
            return "ar"
        if self.mode == "sd":
            return f"sd γ={self.gamma}"
        if self.mode == "recycle":  # the recycled tree and the lookup, no draft model: sized by cost, no knob
            return "recycle"
        budget = f" B={self.branches}" if self.branches is not None else ""
        return f"mirror κ={self.kappa} γ={self.gamma} ℓe={self.exit_layer}{budget}"

    @property
    def g(self) -> int:
        """γ, set for modes sd and mirror (the ones that draft)."""
        assert self.gamma is not None, f"{self.mode} drafts no window"
        return self.gamma

    @property
    def k(self) -> int:
        """κ, set for mode mirror."""
        assert self.kappa is not None, f"{self.mode} reuses no candidates"
        return self.kappa

    @property
    def e(self) -> int:
        """ℓ_e, set for mode mirror."""
        assert self.exit_layer is not None, f"{self.mode} has no early exit"
        return self.exit_layer

    @property
    def rows(self) -> int:
        """Branches a mirror step rolls out: κ(γ+1), or B under a budget."""
        every = self.k * (self.g + 1)
        return every if self.branches is None else min(self.branches, every)


@dataclass
class Trace:
    """One greedy continuation, teacher-forced through target and draft."""

    # [i]: how many tokens of the draft's window started at position i equal the target's, in a row (capped at
    # the longest γ measured); a shorter window's accepted length is min(γ, runs[i])
    runs: list[int]
    # [ℓ][i]: the target token's rank among the early exit's at layer ℓ, the draft's own token left out (the
    # engine's excluded-token rule at a rejected row)
    rank_excl: dict[int, list[int]] = field(default_factory=dict)
    rank_plain: dict[int, list[int]] = field(default_factory=dict)  # the same with nothing left out (the bonus row)


def _steps(trace: Trace, gamma: int) -> Iterable[tuple[int, int]]:
    """(position, accepted length) of each greedy step along `trace` with window γ, but the last one when the
    text ends inside its window."""
    n, p = len(trace.runs), 0
    while p < n:
        a = min(gamma, trace.runs[p], n - p)
        if p + a >= n:
            return
        yield p, a
        p += a + 1


def replay(trace: Trace, gamma: int, kappa: Optional[int] = None, exit_layer: Optional[int] = None,
           cells: Optional[Counter] = None) -> tuple[int, int, int]:
    """(steps, tokens, reuses) of greedy speculative decoding along `trace` with window γ; `cells` counts the
    reused steps by branch: (the row the step ended at, the correction's rank among its candidates)."""
    steps = tokens = reuses = end = 0
    for p, a in _steps(trace, gamma):
        if kappa is not None:
            assert exit_layer is not None, "mirror's κ comes with its ℓ_e"
            r = (trace.rank_excl if a < gamma else trace.rank_plain)[exit_layer][p + a]
            reuses += r < kappa
            if cells is not None and r < kappa:
                cells[(a, r)] += 1
        steps, tokens, end = steps + 1, tokens + a + 1, p + a + 1
    if end < len(trace.runs):  # the text ended inside the last window
        steps, tokens = steps + 1, tokens + len(trace.runs) - end
    return steps, tokens, reuses


@dataclass
class Acceptance:
    """What the traces say per knob: tokens per step per γ, reuse per (κ, γ, ℓ_e)."""

    traces: list[Trace]

    def _sum(self, gamma: int, kappa=None, exit_layer=None) -> tuple[int, int, int]:
        totals = [replay(t, gamma, kappa, exit_layer) for t in self.traces]
        return tuple(sum(x) for x in zip(*totals)) if totals else (0, 0, 0)

    def mean_tokens(self, gamma: int) -> float:
        steps, tokens, _ = self._sum(gamma)
        return tokens / steps if steps else 1.0

    def reuse_rate(self, kappa: int, gamma: int, exit_layer: int, branches: Optional[int] = None) -> float:
        """Steps whose correction's branch was rolled out: among the κ(γ+1), or the B that held the most."""
        steps, _, reuses = self._sum(gamma, kappa, exit_layer)
        if branches is not None and branches < kappa * (gamma + 1):
            cells: Counter = Counter()
            for t in self.traces:
                replay(t, gamma, kappa, exit_layer, cells)
            reuses = sum(sorted(cells.values(), reverse=True)[:branches])
        return reuses / steps if steps else 0.0

    def window_counts(self, gamma: int) -> tuple[int, int]:
        """(accepted, rejections) along the traces with window γ, as Stats counts them in a real run
        (α = accepted / (accepted + rejections))."""
        accepted = [a for t in self.traces for _, a in _steps(t, gamma)]
        return sum(accepted), sum(a < gamma for a in accepted)


def geometric_tokens(alpha: float, gamma: int) -> float:
    """Tokens a step commits on average when each draft token is right with probability α on its own
    (the i.i.d. model of docs/design.md §2): 1 + α + ... + α^γ. Used only as a ratio, to carry a trace's
    measured tokens per step over to another acceptance (tune.expected_rate)."""
    return sum(alpha**i for i in range(gamma + 1))


@dataclass
class Timings:
    """Measured seconds, keyed by what was varied."""

    verify: dict = field(default_factory=dict)  # [rows]: a plain target forward over `rows` new tokens
    prefix: dict = field(default_factory=dict)  # [(ℓ_e, rows)]: the target forward's layers up to the exit
    suffix: dict = field(default_factory=dict)  # [(ℓ_e, rows)]: and its layers after it
    window: dict = field(default_factory=dict)  # [γ]: a 1-row rollout through the host (mirror's fallback, sd's)
    local_window: dict = field(default_factory=dict)  # [γ]: sd's window where it drafts in-process (an MLX draft)
    # [(ℓ_e, κ, γ)]: suffix and κ(γ+1)-row rollout run at once, measured where it can change the top (parallel_time)
    parallel: dict = field(default_factory=dict)
    rollout: dict = field(default_factory=dict)  # [(rows, γ)]: the rollout alone (its floor; beside `parallel`)
    # [mode]: real step time minus the modelled components, a number or {γ: seconds} (`overhead`); negative
    # where the components timed alone cost more than inside a real step
    overhead: dict = field(default_factory=dict)
    # [rows]: across ranks, one forward's collectives timed alone (two all_sums per sharded layer); {} in one
    # process. verify, prefix and suffix then hold the compute alone (timing.split_comm): T_comm is added once
    comm: dict = field(default_factory=dict)
    comm_prefix: dict = field(default_factory=dict)  # [(ℓ_e, rows)]: comm's share before the exit (ℓ_e of N layers)
    prepare: dict = field(default_factory=dict)  # [γ]: mirror's prepare (two tokens and the window) beside the prefix


def comm_time(t: Timings, rows: int, exit_layer: Optional[int] = None, part: str = "forward") -> float:
    """T_comm of a target forward over `rows` rows: the whole forward's, or its "prefix" / "suffix" at
    ℓ_e; 0 in one process (`t.comm` empty)."""
    if not t.comm:
        return 0.0
    whole = t.comm[rows]
    if part == "forward":
        return whole
    before = t.comm_prefix[(exit_layer, rows)]
    return before if part == "prefix" else whole - before


def component_time(cfg: Config, t: Timings, reuse: float = 0.0) -> float:
    """Seconds per step without the per-mode overhead."""
    if cfg.mode == "ar":
        return t.verify[1] + comm_time(t, 1)
    g = cfg.g
    if cfg.mode == "sd":
        return (t.local_window or t.window)[g] + t.verify[g + 1] + comm_time(t, g + 1)
    rows = g + 1
    return (t.prefix[(cfg.e, rows)] + comm_time(t, rows, cfg.e, "prefix") + parallel_time(cfg, t)
            + (1 - reuse) * t.window[g])


def suffix_and_late(cfg: Config, t: Timings) -> tuple[float, float]:
    """A mirror point's suffix (with its T_comm), and how late its rollout starts past the prefix: by the
    prepare that outlasts the prefix."""
    g, e = cfg.g, cfg.e
    return (t.suffix[(e, g + 1)] + comm_time(t, g + 1, e, "suffix"),
            max(0.0, t.prepare.get(g, 0.0) - t.prefix[(e, g + 1)]))


def parallel_time(cfg: Config, t: Timings) -> float:
    """T_par: measured when `t.parallel` has the point (the suffix's collectives in it), else its floor
    max(T_suffix + its T_comm, T_rollout alone) (running both at once only adds contention), so a
    prediction without it is an upper bound."""
    g = cfg.g
    measured = t.parallel.get((cfg.e, cfg.k, g))
    every = cfg.k * (g + 1)
    if measured is not None and cfg.rows == every:
        return measured
    suffix, late = suffix_and_late(cfg, t)
    floor = max(suffix, late + rollout_time(t, cfg.rows, g))
    if measured is None:
        return floor
    return floor * measured / max(suffix, late + rollout_time(t, every, g))  # a budget: contention measured at κ(γ+1)


def rollout_time(t: Timings, rows: int, gamma: int) -> float:
    """T_rollout of `rows` branches of depth γ: measured at that row count, else read between the row counts
    measured at γ (one row: the serial window)."""
    points = {n: v for (n, g), v in t.rollout.items() if g == gamma}
    return _read({1: t.window[gamma], **points} if gamma in t.window else points, rows)


def overhead(cfg: Config, t: Timings) -> float:
    """The mode's per-step overhead at `cfg`: a number, or {γ: seconds} from probes at a few γ, read between
    them (per-step messages and bookkeeping grow with the window)."""
    o = t.overhead.get(cfg.mode, 0.0)
    return _read(o, cfg.gamma or min(o)) if isinstance(o, dict) else o


def _read(points: dict, x: float) -> float:
    """The value at `x` of measured {x: value}: linear between the nearest two, flat beyond the ends."""
    xs = sorted(points)
    x = min(max(x, xs[0]), xs[-1])
    lo, hi = max(k for k in xs if k <= x), min(k for k in xs if k >= x)
    return points[lo] if hi == lo else points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)


def fitted(cfg: Config, t: Timings) -> Config:
    """A mirror point with no B as the engine runs it: the branches whose rollout ends within the suffix
    (branch_budget.RolloutCost), at least one; every branch while the rollout is not timed."""
    if cfg.mode != "mirror" or cfg.branches is not None or not any(g == cfg.gamma for _, g in t.rollout):
        return cfg
    every, (suffix, late) = cfg.rows, suffix_and_late(cfg, t)
    n = max([1] + [n for n in range(1, every + 1) if late + rollout_time(t, n, cfg.g) <= suffix])
    return cfg if n == every else replace(cfg, branches=n)


def predict(cfg: Config, t: Timings, acc: Acceptance) -> dict:
    """Predicted tokens/s of `cfg`, with the terms behind it ("bound": suffix ‖ rollout not measured at this
    point, so an upper bound, see parallel_time)."""
    ran = fitted(cfg, t)  # (the point as it runs: its branches fitted to the suffix when no B is given)
    tokens = 1.0 if cfg.mode == "ar" else acc.mean_tokens(cfg.g)
    reuse = acc.reuse_rate(ran.k, ran.g, ran.e, ran.branches) if cfg.mode == "mirror" else 0.0
    component = component_time(ran, t, reuse)
    step = max(component + overhead(cfg, t), component / 2)  # (a negative overhead is a correction)
    bound = cfg.mode == "mirror" and (cfg.exit_layer, cfg.kappa, cfg.gamma) not in t.parallel
    return {"config": cfg, "tokens_per_step": tokens, "reuse": reuse, "step_s": step,
            "tokens_per_second": tokens / step if step > 0 else 0.0, "bound": bound,
            "comm_s": comm_time(t, 1 if cfg.mode == "ar" else cfg.g + 1)}  # the step's target forwards


def rank(configs: Iterable[Config], t: Timings, acc: Acceptance) -> list[dict]:
    """Predictions for every config, fastest first."""
    return sorted((predict(c, t, acc) for c in configs), key=lambda p: -p["tokens_per_second"])


def grid(kappas: Iterable[int], gammas: Iterable[int], exit_layers: Iterable[int],
         branches: Iterable[Optional[int]] = (None,)) -> list[Config]:
    """ar, sd at every γ and mirror at every (κ, γ, ℓ_e) and branch budget B (those below κ(γ+1), and None:
    every branch)."""
    return ([Config("ar")] + [Config("sd", gamma=g) for g in gammas]
            + [Config("mirror", k, g, e, branches=b) for e in exit_layers for k in kappas for g in gammas
               for b in branches if b is None or b < k * (g + 1)])


# --- the choice: how auto scores a measured configuration and picks one (the calibration's choice, and the same
# rule on what auto's own runs have seen since: `Seen`)

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


def describe(c: Union[Config, "Choice", "Profile", "Stats"]) -> str:
    """The configuration in words: "ar", "sd γ=3", "mirror κ=1 γ=3 ℓe=7", "recycle" (a run whose recycled tree
    proposed, `Stats.recycle`, says so too)."""
    if getattr(c, "recycle", "") and c.mode == "sd":
        return "recycle"
    mirror = c.mode == "mirror"
    return Config(c.mode, c.kappa if mirror else None, c.gamma if c.mode != "ar" else None,
                  c.exit_layer if mirror else None,
                  branches=getattr(c, "branches", None) if mirror else None).name
