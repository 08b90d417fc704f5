"""mode="auto" at run time: resolve each call's mode and knobs from the pair's profile (loaded, or
calibrated on first use), adapt them across calls to what auto's own runs have seen (`adapt`: a more
predictable text favours longer windows), and within a call leave the draft once the text at hand defeats
it (`leave_draft`, run by the engine after each step through `AutoRun`).
"""

import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Optional

from .. import validate
from ..proposers.lookup import LOOKUP_GAMMA, NGRAM_MIN
from ..options import PAPER_KNOBS, DecodeOptions
from ..proposers.proposing import Proposing
from ..proposers.recycle import RECYCLE
from . import profile as profiles
from .profile import AutoState, PairView
from .cost_model import AR_MARGIN, Choice, Seen, choose, describe, expected_rate, row_config

if TYPE_CHECKING:
    from ..engine.stats import Stats, Step

PRIOR_TOKENS = 64  # in `adapt` the calibration's acceptance weighs at most this many tokens of the user's text
PRIOR_STEPS = 16  # and the table's predicted reuse this many Mirror-SD steps (about as many tokens)
# Within one generation (`leave_draft`) the text at hand counts for more: a prompt unlike any before
# (an extraction after stories) defeats the draft from its first steps.
WITHIN_PRIOR_TOKENS, WITHIN_PRIOR_STEPS = 8, 4
WITHIN_MIN_JUDGED = 16  # draft tokens judged in a generation before auto may leave the draft in it

Counts = list  # [draft tokens accepted, rejecting steps, steps that reused a branch, fallbacks]
ConfigKey = tuple  # (mode, κ, γ, ℓe) of a speculative configuration, None where the mode has no such knob


@dataclass
class AutoRun:
    """Mode auto's watch over one generation: called by the engine after each step (why to go on with the
    target alone, or None), then `done` with the generation's stats (what `adapt` learns from)."""

    state: AutoState
    sampling: Optional[tuple]
    config: ConfigKey
    test: Optional[Callable[[Counts], Optional[str]]] = None
    counts: Counts = field(default_factory=lambda: [0, 0, 0, 0])

    def __call__(self, step: "Step") -> Optional[str]:
        if step.stats.lookup_windows:  # the prompt lookup's window, not the draft's: nothing on the draft
            return None
        for i, n in enumerate((step.accepted, step.offered > step.accepted, step.reused, step.fallback)):
            self.counts[i] += int(n)
        return self.test(list(self.counts)) if self.test is not None else None

    def done(self, stats: "Stats") -> None:
        """Learn the model draft's counts (the lookup's windows left out)."""
        if self.sampling is None or stats.proposed <= stats.lookup_proposed:  # a custom sampler: nothing to key
            return
        seen = self.state.seen.setdefault(self.sampling, {}).setdefault(self.config, [0, 0, 0, 0])
        for i, n in enumerate((stats.accepted - stats.lookup_accepted, stats.rejections - stats.lookup_rejections,
                               stats.reuses, stats.fallbacks)):
            seen[i] += n


def config_key(mode: str, kappa: Optional[int], gamma: Optional[int], exit_layer: Optional[int],
               branches: Optional[int] = None) -> ConfigKey:
    """(mode, κ, γ, ℓe), and mirror's branch budget B after them where it has one."""
    mirror = mode == "mirror"
    key = (mode, kappa if mirror else None, gamma, exit_layer if mirror else None)
    return key + (branches,) if mirror and branches is not None else key


def row_key(row: dict) -> ConfigKey:
    return config_key(row["mode"], row["kappa"], row["gamma"], row["exit_layer"], row.get("branches"))


@dataclass(frozen=True)
class PairFacts:
    """What resolving a call's mode needs to know of the pair: whether it has a draft model, and ℓ_e when
    none is asked (the exit adapter's layer, else N // 2)."""

    has_draft: bool
    default_exit: int
    proposing: Proposing = Proposing()  # what the pair proposes with (a draft model, or "lookup" / "recycle")


ProfileSource = Callable[[str, float], profiles.Profile]  # the pair's profile, loaded or calibrated when first
# asked (its arguments: the mode asking for it, for the calibration's line, and the call's temperature, which a
# first call's calibration runs at): Pipeline.profile


_calibrating = threading.Lock()  # two threads' first auto calls calibrate once, not twice at once


def profile_for(pipe: PairView, asking: str = "auto", temperature: float = 0.0) -> profiles.Profile:
    """The pipeline's profile: in memory, else on disk, else a quick calibration at the call's `temperature` (one
    line on stderr, naming the mode `asking` for it: auto, or an explicit mode whose knobs were left out)."""
    if pipe.auto.profile is not None:
        return pipe.auto.profile
    with _calibrating:
        if pipe.auto.profile is None:
            key = profiles.pipe_key(pipe)
            try:
                pipe.auto.profile = profiles.saved(key, pipe.engine)
            except profiles.ProfileError as e:
                print(f"mirror-mlx: {e}; recalibrating", file=sys.stderr)
            if pipe.auto.profile is None:
                pipe.auto.profile = _quick_calibration(pipe, key, asking, temperature)
        return pipe.auto.profile


def _quick_calibration(pipe: PairView, key: dict, asking: str, temperature: float = 0.0) -> profiles.Profile:
    """A first call's calibration within its budget, at the call's temperature; ar, said on stderr, when it runs
    out or fails."""
    from .calibrate import OutOfTime, TuneConfig, calibrate  # (calibration loads on a pair's first auto call only)

    t0 = time.perf_counter()
    cfg = TuneConfig.quick(temperature)
    try:
        prof = calibrate(pipe, cfg, key=key)
    except OutOfTime:  # the safe rule: plain generation is never slower than itself
        ran_out = f"quick calibration ran out of its {cfg.budget_s:g} s budget (MIRROR_MLX_QUICK_BUDGET)"
        prof = profiles.Profile(key=key, mode="ar", why=f"{ran_out}, so ar, the safe rule")
        print(f"mirror-mlx: mode {asking}: {ran_out}, so {_instead(asking, 'ar, the safe rule')}; not saved "
              "(`mirror-mlx tune` measures without a budget)", file=sys.stderr)
    except Exception as e:  # a draft that fails here would fail in generation too: plain, visibly
        failed = f"quick calibration failed ({e!r})"
        prof = profiles.Profile(key=key, mode="ar", why=f"{failed}, so ar")
        print(f"mirror-mlx: warning: mode {asking}: {failed}, so {_instead(asking, 'ar')}; not saved", file=sys.stderr)
    else:
        assert prof is not None, "one process: calibrate returns the profile (ranks beside rank 0 read rank 0's)"
        prof.why = "quick " + prof.why
        try:
            saved = f"saved {profiles.save(prof)}"
        except profiles.ProfileError as e:  # an unwritable cache: this process keeps it in memory
            saved = f"warning: {e}"
        at = f" at temperature {temperature:g}" if temperature > 0 else ""
        print(f"mirror-mlx: mode {asking}: no tuning profile for this pair, quick calibration{at} "
              f"({time.perf_counter() - t0:.1f} s) chose {describe(prof)}; {saved} "
              "(`mirror-mlx tune` measures more)", file=sys.stderr)
    return prof


def _instead(asking: str, auto_runs: str) -> str:
    """What runs without a calibrated table: auto runs `auto_runs`; an explicit mode its small safe knobs
    (`knobs_from`)."""
    return auto_runs if asking == "auto" else f"{asking} runs small safe knobs, uncalibrated"


def pooled_ratio(counts: list[tuple[float, int, int]], prior_weight: int) -> tuple[float, int]:
    """(the weighted mean of seen / expected, how many seen): `counts` holds (expected rate, hits, misses)
    per group; each group's rate is pooled with its expected one, which weighs as `prior_weight` hits and
    misses (the user's text need not be like the calibration's, so it soon outweighs it)."""
    num, n = 0.0, 0
    for expected, hits, misses in counts:
        if expected <= 0 or not hits + misses:
            continue
        pooled = (expected * prior_weight + hits) / (prior_weight + hits + misses)
        num += (hits + misses) * pooled / expected
        n += hits + misses
    return (num / n if n else 1.0), n


def observed(prof: profiles.Profile, seen: dict[tuple, list[int]], prior_tokens: int = PRIOR_TOKENS,
             prior_steps: int = PRIOR_STEPS) -> Optional[Seen]:
    """`Seen` from auto's runs at one sampling setting (AutoState.seen[setting]): per γ, the draft's α against
    the calibration traces' (pooled with them at `prior_tokens`); per Mirror-SD configuration, its branch reuse
    against the table's prediction (pooled at `prior_steps`). None before anything was seen, or for a profile
    without acceptance counts (a quick one that fell back to ar)."""
    prior = prof.calibration.get("acceptance")
    if not prior or not seen:
        return None
    alphas = {int(g): a / max(a + r, 1) for g, (a, r) in prior.items()}
    per_gamma: dict[int, list[int]] = {}
    for (_, _, g, *_), (a, r, *_) in seen.items():
        totals = per_gamma.setdefault(g, [0, 0])
        totals[0], totals[1] = totals[0] + a, totals[1] + r
    acceptance, tokens = pooled_ratio([(alphas.get(g, 0.0), a, r) for g, (a, r) in per_gamma.items()],
                                      prior_tokens)
    rows = {row_key(r): r for r in prof.table}
    reuse, steps = pooled_ratio([(rows[c].get("reuse") or 0.0, v[2], v[3]) for c, v in seen.items()
                                 if c[0] == "mirror" and c in rows], prior_steps)
    window = prof.calibration.get("timings", {}).get("window", {})
    return Seen(alphas, {int(g): 1e3 * s for g, s in window.items()}, acceptance, reuse, tokens, steps)


def adapt(prof: profiles.Profile, seen: dict[tuple, list[int]], setting: str = "temperature 0") -> Optional[Choice]:
    """The profile's choice on the text auto has served at one sampling setting: every confirmed row
    re-scored (`expected_rate`) at the acceptance and reuse seen there (`observed`), its measured step time
    kept. None before anything was seen."""
    s = observed(prof, seen)
    if s is None or not s.tokens or not any(r.get("confirmed") for r in prof.table):
        return None
    tuned = next((r for r in prof.table if r.get("confirmed") and describe(row_config(r)) == describe(prof)), None)
    best, _, margin = choose(prof.table, s, incumbent=tuned)
    reuse = (f", its branches reused {s.reuse:.2f}x as often as predicted ({s.steps} steps)"
             if s.steps else "")
    why = (f"adapted: at {setting} the draft is right {s.acceptance:.2f}x as often in auto's runs "
           f"({s.tokens} draft tokens judged) as in calibration{reuse}, "
           f"{expected_rate(best, s):.0f} tok/s expected{margin}")
    return Choice(best["mode"], best["kappa"] or PAPER_KNOBS["kappa"], best["gamma"] or PAPER_KNOBS["gamma"],
                  best["exit_layer"], why, best.get("branches"))


def leave_draft(prof: profiles.Profile, c: Choice) -> Optional[Callable[[Counts], Optional[str]]]:
    """For auto's speculative choice `c`: the engine's test after each step, on the generation's `Counts` so far:
    why to go on with ar once the text at hand (pooled with the calibration at WITHIN_PRIOR_*) puts ar's
    expected rate AR_MARGIN above the choice's (`adapt` learns across generations, this within one). None
    where there is nothing to compare (ar, no confirmed row for `c`, a profile without counts)."""
    rows = [r for r in prof.table if r.get("confirmed") and r.get("measured_step_ms")]
    here = next((r for r in rows if r["mode"] != "ar" and describe(row_config(r)) == describe(c)), None)
    ar = next((r for r in rows if r["mode"] == "ar"), None)
    if c.mode == "ar" or here is None or ar is None or not prof.calibration.get("acceptance"):
        return None
    config = config_key(c.mode, c.kappa, c.gamma, c.exit_layer, c.branches)

    def test(counts: list) -> Optional[str]:
        if counts[0] + counts[1] < WITHIN_MIN_JUDGED:
            return None
        s = observed(prof, {config: counts}, WITHIN_PRIOR_TOKENS, WITHIN_PRIOR_STEPS)
        rate, plain = expected_rate(here, s), expected_rate(ar, s)
        if s is None or plain < AR_MARGIN * rate:
            return None
        reuse = f", its branches reused {s.reuse:.2f}x as often as predicted" if s.steps else ""
        return (f"the draft is right {s.acceptance:.2f}x as often in this text ({s.tokens} draft tokens judged) "
                f"as in calibration{reuse}: {rate:.0f} tok/s expected, ar {plain:.0f}")

    return test


def setting_name(sampling: tuple) -> str:
    """DecodeOptions.sampling in words, for `why`."""
    if sampling[0] == 0:
        words = ["temperature 0"]
    else:
        t, top_p, top_k, min_p = sampling[:4]
        words = [f"temperature {t:g}"] + ([f"top_p {top_p:g}"] if top_p < 1 else []) + \
            ([f"top_k {top_k}"] if top_k else []) + ([f"min_p {min_p:g}"] if min_p else [])
    return " ".join(words + ([f"repetition_penalty {sampling[-1]:g}"] if sampling[-1] is not None else []))


def choice(profile: ProfileSource, auto: AutoState, facts: PairFacts, kappa: Optional[int], gamma: Optional[int],
           exit_layer: Optional[int], sampling: Optional[tuple] = None,
           lookup: bool = False) -> tuple[Choice, Optional[Callable]]:
    """Mode auto's mode and knobs: the knobs given win, the rest from the profile adapted to what auto's runs at
    this `sampling` setting have seen (`adapt`), with the test within the generation (`leave_draft`). With
    `lookup`, where auto would run ar it runs the lookup beside the target alone (`beside_lookup`)."""
    if lookup and facts.has_draft:
        c, test = choice(profile, auto, facts, kappa, gamma, exit_layer, sampling)
        if c.mode != "ar":
            return c, test
        return beside_lookup(c, gamma), None

    def knobs(k: Optional[int], g: Optional[int], e: Optional[int], why: str, m: str = "mirror",
              b: Optional[int] = None) -> tuple:
        return Choice(m, PAPER_KNOBS["kappa"] if k is None else k, PAPER_KNOBS["gamma"] if g is None else g, e, why,
                      b if m == "mirror" else None), None

    if not facts.has_draft:
        return knobs(kappa, gamma, exit_layer, "auto: no draft model, so ar", "ar")
    if kappa is not None and gamma is not None:  # Mirror-SD fully asked for: nothing to look up
        return knobs(kappa, gamma, exit_layer, "auto with kappa and gamma given: mirror with them")
    prof = profile("auto", sampling[0] if sampling else 0.0)
    asked = {k: v for k, v in dict(kappa=kappa, gamma=gamma, exit_layer=exit_layer).items() if v is not None}
    if not asked:
        # a copy (dict() is one step under the GIL): a generation on another thread may add to it meanwhile
        seen = {c: list(v) for c, v in dict(auto.seen.get(sampling) or {}).items()} \
            if sampling is not None else None
        adapted = adapt(prof, seen, setting_name(sampling)) if seen and sampling is not None else None
        if adapted is not None:
            c = replace(adapted, why="auto: " + adapted.why)
        else:
            c, _ = knobs(prof.kappa, prof.gamma, prof.exit_layer, "auto: " + prof.why, prof.mode)
            c = replace(c, branches=prof.branches)
        return c, leave_draft(prof, c)
    # Explicit knobs: the best row of the profile's table that has them (κ or ℓ_e imply mirror).
    need = "mirror" if {"kappa", "exit_layer"} & asked.keys() else None
    rows = [r for r in prof.table if r["mode"] != "ar" and (need is None or r["mode"] == need)
            and all(r.get(k) == v for k, v in asked.items())]
    if not rows and not prof.table:  # nothing measured (across ranks without a tuned profile): the safe knobs
        return knobs(SAFE_KNOBS["kappa"] if kappa is None else kappa, SAFE_KNOBS["gamma"] if gamma is None else gamma,
                     exit_layer, f"auto with knobs given: mirror with them, the rest small safe defaults, "
                                 f"uncalibrated ({prof.why})")
    if not rows:
        return knobs(kappa, gamma, exit_layer, "auto with knobs outside the profile's grid: mirror with them")
    r = best_point(rows)
    why = "auto with " + ", ".join(f"{k}={v}" for k, v in asked.items()) + ": best such point in the profile"
    return knobs(r["kappa"] if kappa is None else kappa, r["gamma"] if gamma is None else gamma,
                 r["exit_layer"] if exit_layer is None else exit_layer, why, r["mode"], r.get("branches"))


def best_point(rows: list[dict]) -> dict:
    """The fastest of profile rows: every row with a measured step (confirmed or probe) scored as auto scores
    rows (`expected_rate`), and only where none was measured the best prediction. A measurement beats any
    prediction: confirming tries the top predictions, which can measure far below what they predicted (a
    wide κ whose rollout outgrows the suffix)."""
    return max(rows, key=lambda r: (bool(r.get("measured_step_ms")),
                                    expected_rate(r) if r.get("measured_step_ms") else r["predicted"]))




def modelless(opts: DecodeOptions, asked: str, gamma: Optional[int], draft: str) -> DecodeOptions:
    """sd with no draft model (draft_model="lookup" or "recycle"): no profile to read, as no draft model runs
    (a wrong proposal costs the verify's extra rows only, and each proposal is cut to what pays at the
    measured row cost); the lookup's window γ as given, else LOOKUP_GAMMA."""
    alone = "the recycled draft (no draft model), so sd with its trees" if draft == "recycle" else \
        "the lookup alone (no draft model), so sd with it"
    why = f"auto: {alone}" if asked == "auto" else "mode sd as asked"
    if gamma is None:
        why += f"; gamma={LOOKUP_GAMMA}, the lookup's default"
    return replace(opts, mode="sd", gamma=LOOKUP_GAMMA if gamma is None else gamma, why=opts.why or why)


def beside_lookup(c: Choice, gamma: Optional[int]) -> Choice:
    """auto with lookup=True beside a model draft, where auto alone would run ar (`c`, the draft not paying on
    this machine): the lookup beside the target alone, as the lookup alone runs (windows of γ, LOOKUP_GAMMA
    unless given; no draft window where it proposes none). The engine runs that as ar with the lookup's
    index; said in `why`. (sd with the draft would pay the draft's window on every step the context offers
    none: on SmolLM2-135M with its 6-layer draft 0.4-0.8x ar, docs/bench/lookup-real.md.)"""
    g = LOOKUP_GAMMA if gamma is None else gamma
    return Choice("ar", c.kappa, g, None, f"auto with lookup: the lookup beside the target alone, gamma={g} "
                                          f"(auto alone: {describe(c)}; {c.why})")


def tree_beside(checked: DecodeOptions, c: Choice, asked: DecodeOptions) -> DecodeOptions:
    """auto's choice of the recycled tree beside a model draft (the calibration measured it faster than the draft
    and than ar): sd with the recycled tree and, unless asked off, the lookup, as `draft_model="recycle"` runs
    them; the draft model waits."""
    return replace(checked, mode="sd", gamma=LOOKUP_GAMMA if asked.gamma is None else checked.gamma,
                   lookup=True if asked.lookup is None else checked.lookup, proposer=RECYCLE, why=checked.why or c.why)


SAFE_KNOBS = dict(kappa=1, gamma=3)  # an explicit mode's knobs when no profile has a row for it: small, cheap


def explicit(profile: ProfileSource, facts: PairFacts, mode: str, kappa: Optional[int], gamma: Optional[int],
             exit_layer: Optional[int]) -> Choice:
    """An explicit mode: the knobs given win; those left out come from the pair's profile (`knobs_from`), else
    small safe ones said to be uncalibrated: never the paper's κ=8, γ=7 blindly (they cost a CPU pair 3x)."""
    if not (mode == "sd" and gamma is None) and not (mode == "mirror" and None in (kappa, gamma)):
        return Choice(mode, PAPER_KNOBS["kappa"] if kappa is None else kappa,
                      PAPER_KNOBS["gamma"] if gamma is None else gamma, exit_layer, f"mode {mode} as asked")
    return knobs_from(profile(mode, 0.0), facts.default_exit, mode, kappa, gamma, exit_layer)


def knobs_from(prof: profiles.Profile, default_exit: Optional[int], mode: str, kappa: Optional[int],
               gamma: Optional[int],
               exit_layer: Optional[int]) -> Choice:
    """`explicit`'s knobs from a given profile (across ranks, the one `tune` wrote for them): its best row for
    `mode` that has the knobs given, else SAFE_KNOBS (ℓ_e the exit adapter's layer or N/2)."""
    given = {k: v for k, v in dict(kappa=kappa, gamma=gamma, exit_layer=exit_layer).items()
             if v is not None and (mode == "mirror" or k == "gamma")}
    rows = [r for r in prof.table if r["mode"] == mode]
    fits = [r for r in rows if all(r.get(k) == v for k, v in given.items())]
    if not fits:  # an exit layer outside the grid: the best κ, γ of the grid at any layer
        fits = [r for r in rows if all(r.get(k) == v for k, v in given.items() if k != "exit_layer")]
    names = ("kappa", "gamma", "exit_layer") if mode == "mirror" else ("gamma",)
    if fits:
        best = best_point(fits)
        got = {k: given.get(k, best[k]) for k in names}
        if mode == "mirror" and best.get("branches") is not None:  # the row's B, with the row's κ and γ
            got["branches"] = best["branches"]
        ranks = f" of {prof.key['ranks']} ranks" if prof.key.get("ranks") else ""  # across ranks: tune's for them
        source = "the profile (quick calibration)" if prof.why.startswith("quick") else f"the tuned profile{ranks}"
    else:
        got = {k: given.get(k, SAFE_KNOBS.get(k)) for k in names}
        if mode == "mirror" and got["exit_layer"] is None:
            got["exit_layer"] = default_exit
        source = f"small safe defaults, uncalibrated (the profile has no {mode} row: {prof.why})"
    picked = " ".join(f"{k}={v}" for k, v in got.items() if k not in given)
    return Choice(mode, got.get("kappa", PAPER_KNOBS["kappa"]), got["gamma"], got.get("exit_layer", exit_layer),
                  f"mode {mode} as asked; {picked} from {source}", got.get("branches"))


def resolve(asked: DecodeOptions, checked: DecodeOptions, profile: ProfileSource, auto: AutoState,
            facts: PairFacts) -> tuple[DecodeOptions, Optional[AutoRun]]:
    """A call's concrete mode and knobs, the one place they are picked, from the caller's options as given
    (`asked`) and as checked (auto as its stand-in), the pair's profile (asked only where the choice needs it)
    and facts: explicit knobs win, an explicit mode's missing ones come from the profile (`explicit`), and
    mode auto gets the tuned ones and an `AutoRun` over `auto` to watch the generation."""
    alone = facts.proposing.modelless(checked.mode, checked.lookup)  # sd with the lookup or the recycled tree
    if alone:
        return modelless(checked, asked.mode, asked.gamma, alone), None  # nothing to calibrate
    if asked.mode != "auto":
        c = explicit(profile, facts, asked.mode, asked.kappa, asked.gamma, asked.exit_layer)
        out = replace(checked, kappa=c.kappa, gamma=c.gamma, exit_layer=c.exit_layer, why=checked.why or c.why,
                      branches=checked.branches if checked.branches is not None else c.branches)
        if out.mode == "mirror" and asked.branches is not None:  # the caller's B against the picked κ, γ
            validate.branch_budget(out.branches, c.kappa, c.gamma)
        return out, None
    kappa, gamma = (None if a is None else b for a, b in ((asked.kappa, checked.kappa), (asked.gamma, checked.gamma)))
    c, test = choice(profile, auto, facts, kappa, gamma, checked.exit_layer, checked.sampling, bool(checked.lookup))
    if c.mode == RECYCLE:
        out = tree_beside(checked, c, asked)
    else:
        out = replace(checked, mode=c.mode, kappa=c.kappa, gamma=c.gamma, exit_layer=c.exit_layer,
                      why=checked.why or c.why,
                      branches=checked.branches if checked.branches is not None else c.branches)
    undrafted = out.mode == "ar" or out.proposer == RECYCLE  # the lookup beside the target alone, or in the tree
    if undrafted and out.lookup and asked.ngram_min is None:
        out = replace(out, ngram_min=min(NGRAM_MIN, out.ngram_max))  # its n as the lookup alone's
    if c.mode == RECYCLE:  # the tree sizes itself by measured cost each step: no window to watch
        return out, None
    layer = (out.exit_layer if out.exit_layer is not None else facts.default_exit) if c.mode == "mirror" else None
    return out, AutoRun(auto, checked.sampling, config_key(c.mode, c.kappa, c.gamma, layer, out.branches), test)
