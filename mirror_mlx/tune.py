"""Calibrate the cost model on this machine, pick the fastest mode and knobs, and resolve mode="auto".

`calibrate` measures, in this order (each step real forwards of the loaded models):
1. acceptance traces: the target's greedy text after each calibration prompt, the draft's window at
   every position of it, and the early exit's rank of the target's token at every candidate ℓ_e;
2. component timings (cost_model.Timings): target forwards, prefix / suffix per ℓ_e, 1-row windows,
   suffix ‖ branch rollout run together per (ℓ_e, κ, γ);
3. per-mode overhead: real generations of a few probe configurations, step time minus the modelled
   components (at two γ for sd and mirror), fitted again after step 4 to all their runs;
4. predictions for the whole grid, then real generations of the top few (and ar) to confirm: the
   profile's choice is the fastest confirmed configuration by its *measured* step time and the traces'
   tokens per step, so the choice is never one that only the model believed in.

mode="auto" then adapts that choice to the text it serves (`adapt`): at temperature 0 the draft's
acceptance seen in auto's own generations moves every confirmed configuration's tokens per step (a
more predictable text favours longer windows), their measured step times stay.
"""

import os
import random
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any, Callable, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

from . import profile as profiles
from .cost_model import Acceptance, Config, Timings, Trace, component_time, geometric_tokens, grid, rank
from .draft import MLXDraft
from .exit_adapter import adapter_for, adapter_layers
from .options import PAPER_KNOBS
from .target import EarlyExitTarget, top_k, trimmable_cache

CALIBRATION_POOL = 40  # tune's prompts come from the last this-many held-out openings
PRIOR_TOKENS = 64  # in `adapt` the calibration's acceptance weighs at most this many tokens of the user's text
PRIOR_STEPS = 16  # and the table's predicted reuse this many Mirror-SD steps (about as many tokens)
# Within one generation (`leave_draft`) the text at hand counts for more: a prompt unlike any before
# (an extraction after stories) defeats the draft from its first steps.
WITHIN_PRIOR_TOKENS, WITHIN_PRIOR_STEPS = 8, 4
WITHIN_MIN_JUDGED = 16  # draft tokens judged in a generation before auto may leave the draft in it
AR_MARGIN = 1.05  # speculation must measure this much faster than ar to be chosen (timings are noisy)
QUICK_BUDGET_S = 20.0  # the first-call calibration's cap (MIRROR_MLX_QUICK_BUDGET overrides); then ar
HOST_TIMEOUT_S = 60.0  # a draft host that answers no calibration rollout in this long has failed
# Each piece is timed at least `reps` times and at least `min_timed_s` (MIN_TIMED_S; the quick calibration
# 0.15 s): a ms-scale piece's speed moves by 10-30 % from one tenth of a second to the next on a shared
# machine (a piece of 100 ms or more costs no extra time).
MIN_TIMED_S = 0.3
MAX_REPS = 100


class OutOfTime(RuntimeError):
    """The calibration's time budget ran out."""


def quick_budget() -> float:
    """Seconds the quick calibration may take: $MIRROR_MLX_QUICK_BUDGET, else QUICK_BUDGET_S."""
    env = os.environ.get("MIRROR_MLX_QUICK_BUDGET")
    try:
        return float(env) if env else QUICK_BUDGET_S
    except ValueError:
        return QUICK_BUDGET_S


@dataclass
class TuneConfig:
    """How much to measure. `quick()` is the first-call calibration of mode="auto"."""

    prompts: int = 4  # their traces (one batch) give the acceptance; the first `confirm_prompts` also confirm
    max_tokens: int = 48
    kappas: tuple = (1, 2, 4, 8)
    gammas: tuple = (1, 2, 3, 5, 7)
    exit_layers: Optional[tuple] = None  # None: the adapter's layer, else N/4, N/3, N/2, 3N/4
    reps: int = 3
    confirm: int = 5  # the top predictions measured end to end (ar is always measured too)
    confirm_prompts: int = 2  # the confirmation runs on the first few calibration prompts (tune's time is mostly here)
    min_seconds: float = 4.0  # each real run set goes round its prompts until it has decoded this long
    min_timed_s: float = MIN_TIMED_S  # each timed piece is timed at least this long (`interleaved`)
    probe_two_windows: bool = True  # sd and mirror overhead probed at the smallest and middle γ (else the middle)
    exact_top: int = 5  # this many best predictions have suffix ‖ rollout measured (at least `confirm`)
    progress: bool = True
    budget_s: Optional[float] = None  # stop (OutOfTime) once calibration has taken this long; None: no cap

    @classmethod
    def quick(cls) -> "TuneConfig":
        """Small on purpose: 2 openings × 16 tokens (1 to confirm), κ ∈ {1,2} × γ ∈ {1,2,3}, the middle ℓ_e
        only, one probe per mode, capped."""
        return cls(prompts=2, max_tokens=16, kappas=(1, 2), gammas=(1, 2, 3), reps=2, confirm=2,
                   confirm_prompts=1, min_seconds=0.5, min_timed_s=0.15, probe_two_windows=False, exact_top=2,
                   progress=False, budget_s=quick_budget())


@dataclass
class Choice:
    """A concrete mode and knobs, and why they were chosen (goes into Stats)."""

    mode: str
    kappa: int = PAPER_KNOBS["kappa"]
    gamma: int = PAPER_KNOBS["gamma"]
    exit_layer: Optional[int] = None
    why: str = ""
    leave_draft: Optional[Callable[[list], Optional[str]]] = None  # auto's test within a generation (`leave_draft`)


# --- the calibration prompts ----------------------------------------------------------------------


def calibration_prompts(pipe: Any, n: int, path: Optional[str] = None) -> list[list[int]]:
    """Token ids of `n` prompts: the user's file (prompts.load_prompts) or n of the *last* 40 held-out
    TinyStories openings (benchmarks take theirs from the front, so a tuned profile has never seen a
    bench prompt), as many as can be of one token length: prompts of one length share each target
    forward of the traces' greedy texts (corpus.greedy_continuations batches them). Whole openings, not
    cut ones: a cut opening's greedy text is less predictable (γ=3 accepted 2.18 tokens a step on
    openings cut to 13 tokens, 2.43 whole)."""
    if path:
        from .prompts import load_prompts

        return [pipe.encode(p.text) for p in load_prompts(path, n)]
    from .corpus import load_split

    pool = [pipe.encode(t) for t in reversed(load_split().held_out[-CALIBRATION_POOL:])]  # last first
    by_len: dict[int, list] = {}
    for ids in pool:
        by_len.setdefault(len(ids), []).append(ids)
    common = max(by_len, key=lambda k: (min(len(by_len[k]), n), k))  # the length most of them share
    same = by_len[common][:n]
    return same + [ids for ids in pool if len(ids) != common][: n - len(same)]


# --- 1. acceptance traces -------------------------------------------------------------------------


def exit_layer_candidates(pipe: Any, cfg: TuneConfig) -> list[int]:
    n = pipe.engine.n_layers
    quick = cfg.budget_s is not None and cfg.exit_layers is None  # the capped calibration: N/2 only
    layers = cfg.exit_layers or ((n // 2,) if quick else (n // 4, n // 3, n // 2, 3 * n // 4))
    covered = adapter_layers(pipe.engine.exit_adapter)
    if covered:  # an adapter only maps the state of the layers it is exact at: the candidates among them
        return sorted({e for e in layers if e in covered}) or [pipe.engine.exit_adapter.exit_layer]
    return sorted({min(max(1, e), n - 1) for e in layers})


def _ranks(logits: mx.array, targets: list[int], exclude: list[int]) -> tuple[list[int], list[int]]:
    """Rank of each row's target token (0 = top) with and without the excluded token."""
    logits = logits.astype(mx.float32)
    t = mx.array(targets)[:, None]
    score = mx.take_along_axis(logits, t, axis=-1)
    above = logits > score
    plain = above.sum(axis=-1)
    ex = mx.array(exclude)[:, None]
    ex_above = mx.take_along_axis(above, ex, axis=-1)[:, 0] & (ex[:, 0] != t[:, 0])
    return (plain - ex_above).tolist(), plain.tolist()


def plain_draft_model(pipe: Any) -> Optional[Any]:
    """The draft as a plain MLX model in this process, for the teacher-forced trace: the MLXDraft object
    itself, or for `load()`'s recipe of a plain mlx-lm draft (it lives in the host process) a copy loaded
    here (small; one forward per prompt instead of one host rollout per position). None for other drafts
    (SS drafts propose more than argmax chains, Core ML runs elsewhere): the trace then uses host rollouts."""
    from .ane_draft.host import DraftRecipe, mlx_draft, mlx_draft_model

    draft = getattr(pipe, "draft", None)
    if isinstance(draft, DraftRecipe) and draft.build is mlx_draft:
        return mlx_draft_model(*draft.args)
    return draft.model if type(draft) is MLXDraft else None  # subclasses (SS) propose more than argmax chains


def greedy_texts(pipe: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The target's greedy continuation of each prompt (prompts of one length share each forward)."""
    from .corpus import greedy_continuations

    eos = tuple(getattr(pipe.tokenizer, "eos_token_ids", ()) or ())
    return pipe.engine.target_worker.call(partial(greedy_continuations, pipe.engine.target_model, prompts,
                                                  max_tokens, eos=eos))


def trace(pipe: Any, prompt: list[int], max_tokens: int, exit_layers: Sequence[int], gamma_max: int,
          draft_model: Any = "auto", text: Optional[list[int]] = None) -> tuple[Trace, list[int]]:
    """The acceptance trace of one prompt (cost_model.Trace) from real forwards of both models, and
    the prompt plus the target's greedy text (`text`, else generated here).

    The draft side: one teacher-forced forward of `draft_model` ("auto": `plain_draft_model(pipe)`),
    else (None) one blocking rollout per position through the draft host.
    """
    engine = pipe.engine
    if draft_model == "auto":
        draft_model = plain_draft_model(pipe)
    if text is None:
        text = greedy_texts(pipe, [prompt], max_tokens)[0]
    full = list(prompt) + text
    n0 = len(prompt)

    def draft_runs() -> tuple[list[int], list[int]]:
        runs, first = [], []
        for i in range(n0, len(full)):
            w = engine.host.rollout(full[: i - 1], [[full[i - 1]]], gamma_max, timeout=HOST_TIMEOUT_S).windows[0]
            a = 0
            while a < len(w) and i + a < len(full) and w[a] == full[i + a]:
                a += 1
            runs.append(a)
            first.append(w[0])
        return runs, first

    def teacher_forced() -> tuple[list[int], list[int]]:
        """A plain autoregressive draft: one forward over the text gives its token at every position."""
        first = mx.argmax(draft_model(mx.array([full[:-1]]))[0, n0 - 1:], axis=-1).tolist()
        runs = [0] * (len(text) + 1)
        for i in range(len(text) - 1, -1, -1):
            runs[i] = min(gamma_max, runs[i + 1] + 1) if first[i] == text[i] else 0
        return runs[:-1], first

    runs, first = engine.target_worker.call(teacher_forced) if draft_model is not None else draft_runs()
    tr = Trace(runs=runs)

    def ranks(layer: int) -> tuple[list[int], list[int]]:
        tapped = EarlyExitTarget(engine.target_model, layer, adapter_for(engine.exit_adapter, layer))
        try:
            early, _ = tapped.forward(mx.array([full[:-1]]), cache=None)
            return _ranks(early[0, n0 - 1:], text, first)
        finally:
            tapped.remove()

    for layer in exit_layers:
        tr.rank_excl[layer], tr.rank_plain[layer] = engine.target_worker.call(ranks, layer)
    return tr, full


# --- 2. component timings -------------------------------------------------------------------------


def interleaved(pieces: dict, reps: int, tick: Callable = lambda: None, min_s: float = MIN_TIMED_S) -> dict:
    """{key: median seconds} of pieces timed in rounds, one call of each per round: a burst of load on a
    shared machine then hits every piece alike, not the few timed during it (and the median of at least
    `reps` drops a slow first call). Each piece returns its own seconds (or a tuple of them, medians
    taken per element)."""
    times: dict = {k: [] for k in pieces}

    def enough(k) -> bool:
        ts = times[k]
        total = sum(sum(x) if isinstance(x, tuple) else x for x in ts)
        return len(ts) >= MAX_REPS or (len(ts) >= reps and total >= min_s)

    todo = list(pieces)
    while todo:
        for k in todo:
            times[k].append(pieces[k]())
        done = [k for k in todo if enough(k)]
        for _ in done:
            tick()
        todo = [k for k in todo if k not in done]
    return {k: tuple(map(statistics.median, zip(*ts))) if isinstance(ts[0], tuple) else statistics.median(ts)
            for k, ts in times.items()}


class _Bench:
    """Timed pieces over one committed context, each on the worker that runs it in the engine; each
    method times one call and returns its seconds (`interleaved` repeats them)."""

    def __init__(self, pipe: Any, context: list[int]):
        self.engine, self.context = pipe.engine, context
        self.cache = self.engine.target_worker.call(self._prefill)

    def _prefill(self):
        cache = trimmable_cache(self.engine.target_model)
        self.engine.target_model(mx.array([self.context[:-1]]), cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    def rows(self, n: int) -> mx.array:
        return mx.array([self.context[-n:] if n <= len(self.context) else [self.context[-1]] * n])

    def verify(self, n: int) -> float:
        """A plain target forward over `n` rows."""

        def once():
            t0 = time.perf_counter()
            mx.eval(self.engine.target_model(self.rows(n), cache=self.cache))
            elapsed = time.perf_counter() - t0
            trim_prompt_cache(self.cache, n)
            return elapsed

        return self.engine.target_worker.call(once)

    def split(self, layer: int, n: int) -> tuple[float, float]:
        """(prefix, suffix) seconds at exit layer `layer` over `n` rows."""

        def once():
            tapped = EarlyExitTarget(self.engine.target_model, layer, adapter_for(self.engine.exit_adapter, layer))
            try:
                t0 = time.perf_counter()
                early, final = tapped.forward(self.rows(n), self.cache)
                mx.eval(top_k(early[0], 1))
                t1 = time.perf_counter()
                mx.eval(final)
                t2 = time.perf_counter()
                trim_prompt_cache(self.cache, n)
            finally:
                tapped.remove()
            return t1 - t0, t2 - t1

        return self.engine.target_worker.call(once)

    def stems(self, kappa: int, gamma: int) -> list[list[int]]:
        spine = self.context[-gamma:]
        vocab = self.engine.host.vocab_size
        return [spine[:r] + [(self.context[-1] + 1 + v) % vocab] for r in range(gamma + 1) for v in range(kappa)]

    def sync(self, context: list[int]) -> None:
        """The host's draft cache at `context` (a real step's draft has the committed text synced in)."""
        self.engine.host.post_sync(context)
        self.engine.host.wait_done(HOST_TIMEOUT_S)

    def rollout(self, stems: list[list[int]], gamma: int) -> float:
        """A blocking host rollout after two newly committed tokens (they reach the draft with the request,
        as in a real step): the round trip over the ring, what the scheduler waits for."""
        ctx = self.context[:-1]
        self.sync(ctx[:-2])
        t0 = time.perf_counter()
        self.engine.host.rollout(ctx, stems, gamma, timeout=HOST_TIMEOUT_S)
        return time.perf_counter() - t0

    def parallel(self, layer: int, kappa: int, gamma: int) -> float:
        """The target suffix (on the target's worker) and the κ(γ+1)-row host rollout posted together;
        seconds until both are done."""
        engine, ctx, n = self.engine, self.context[:-1], gamma + 1

        def prefix():
            tapped = EarlyExitTarget(engine.target_model, layer, adapter_for(engine.exit_adapter, layer))
            early, final = tapped.forward(self.rows(n), self.cache)
            mx.eval(early)
            tapped.remove()
            return final

        final = engine.target_worker.call(prefix)
        self.sync(ctx[:-2])
        t0 = time.perf_counter()
        suffix = engine.target_worker.submit(mx.eval, final)
        engine.host.rollout(ctx, self.stems(kappa, gamma), gamma, timeout=HOST_TIMEOUT_S)  # awaited while the suffix runs
        suffix.result()
        elapsed = time.perf_counter() - t0
        engine.target_worker.call(trim_prompt_cache, self.cache, n)
        return elapsed


def measure_timings(pipe: Any, b: _Bench, cfg: TuneConfig, layers: list[int], tick: Callable) -> Timings:
    """Every component but suffix ‖ rollout together (`measure_parallel` does those where they matter)."""
    t = Timings()
    timed = partial(interleaved, reps=cfg.reps, tick=tick, min_s=cfg.min_timed_s)
    t.verify = timed({n: partial(b.verify, n) for n in sorted({1} | {g + 1 for g in cfg.gammas})})
    t.window = timed({g: partial(b.rollout, [[b.context[-1]]], g) for g in cfg.gammas})
    # the rollout alone does not depend on ℓ_e
    t.rollout = timed({(k * (g + 1), g): partial(b.rollout, b.stems(k, g), g) for g in cfg.gammas for k in cfg.kappas})
    halves = timed({(layer, g + 1): partial(b.split, layer, g + 1) for layer in layers for g in cfg.gammas})
    t.prefix = {k: v[0] for k, v in halves.items()}
    t.suffix = {k: v[1] for k, v in halves.items()}
    return t


def measure_parallel(pipe: Any, b: _Bench, t: Timings, configs: list[Config], acc: Acceptance, top: int,
                     reps: int, tick: Callable, min_s: float = MIN_TIMED_S) -> int:
    """Measure suffix ‖ rollout at the mirror points that can reach the `top` best predictions.

    Unmeasured points are predicted at their floor (cost_model.parallel_time), an upper bound; each round
    measures the unmeasured points among the current top, until the top is all measured. Then no
    unmeasured point can be in it (its bound is below the top's last), so the top equals what measuring
    every point would give, at a fraction of the time. Returns how many points were measured.

    A round after the first times the first point measured beside its new ones, and puts them on that
    point's scale (its first time / its time now): the points are compared with one another, and a
    ms-scale pair's speed moves 10-30 % between rounds seconds apart.
    """
    measured = 0
    while True:
        todo = [r["config"] for r in rank(configs, t, acc)[:top] if r["bound"]]
        if not todo:
            return measured
        pieces = {(c.exit_layer, c.kappa, c.gamma): partial(b.parallel, c.exit_layer, c.kappa, c.gamma) for c in todo}
        ref = next(iter(t.parallel), None)
        if ref is not None:
            pieces[ref] = partial(b.parallel, *ref)
        with pipe._lock:
            got = interleaved(pieces, reps, tick, min_s)
        scale = t.parallel[ref] / got.pop(ref) if ref is not None else 1.0
        t.parallel.update({k: v * scale for k, v in got.items()})
        measured += len(todo)


# --- 3./4. real generations -----------------------------------------------------------------------

def pick_confirm(ranked: list[dict], n: int) -> list[Config]:
    """The `n` best predictions, at most ⌊n/2⌋ (at least one) of one window γ: the user's text may accept
    more or less than the calibration's, which moves whole γ groups (`adapt`), so alternatives stay measured."""
    cap, out, per = max(1, n // 2), [], {}
    for r in ranked:
        g = r["config"].gamma
        if len(out) < n and per.get(g, 0) < cap:
            out.append(r["config"])
            per[g] = per.get(g, 0) + 1
    return out


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


def run_configs(pipe: Any, configs: list[Config], prompts: Union[list[list[int]], dict], max_tokens: int,
                warm_up: bool = True, check: Callable[[], None] = lambda: None, sums: Optional[dict] = None,
                min_seconds: float = 0.0) -> dict:
    """Real greedy generations of every config on its prompts, interleaved (in rounds: each config runs its
    next prompt, so a load change on a shared machine hits all configs alike). {config: tokens/s, step_s,
    reuse, sums}. `prompts`: one list for all, or {config: its list}; `sums` (a previous call's, per
    config) are added in: runs of other prompts.

    `min_seconds`: a config's prompts are gone through again until it has decoded this long (a small
    model's 48 tokens take a few ms per token, and single runs of it vary by ±25 % here).
    """
    own = prompts if isinstance(prompts, dict) else {c: prompts for c in configs}
    knobs = {c: dict(mode=c.mode, max_tokens=max_tokens, kappa=c.kappa or 1, gamma=c.gamma or 1,
                     exit_layer=c.exit_layer) for c in configs}
    if warm_up:
        for c in configs:
            check()
            pipe.generate(own[c][0], **dict(knobs[c], max_tokens=4))
    sums = {c: list((sums or {}).get(c, (0, 0, 0, 0.0))) for c in configs}  # tokens, steps, reuses, seconds
    todo, r = [c for c in configs if own[c]], 0
    while todo:
        # each round in its own (seeded) order: whatever a run leaves behind on the machine does not always
        # fall on the same next configuration
        for c in random.Random(r).sample(todo, len(todo)):
            check()
            s = pipe.generate(own[c][r % len(own[c])], **knobs[c]).stats
            for i, v in enumerate((s.generation_tokens, s.steps, s.reuses, s.decode_seconds)):
                sums[c][i] += v
        r += 1
        # a config is done after whole passes over its prompts that add up to min_seconds
        todo = [c for c in todo if r < len(own[c]) or r % len(own[c]) or sums[c][3] < min_seconds]
    return {c: {"tokens_per_second": tok / sec if sec else 0.0, "step_s": sec / max(steps, 1),
                "reuse": reuses / max(steps, 1), "sums": (tok, steps, reuses, sec)}
            for c, (tok, steps, reuses, sec) in sums.items()}


def run_config(pipe: Any, c: Config, prompts: list[list[int]], max_tokens: int, warm_up: bool = True) -> dict:
    """`run_configs` for one configuration."""
    return run_configs(pipe, [c], prompts, max_tokens, warm_up)[c]


def probe_configs(cfg: TuneConfig, layers: list[int]) -> list[Config]:
    """Configurations run for real to measure each mode's overhead: ar; sd and mirror at the smallest
    and the middle γ (their overhead grows with the window)."""
    gs = sorted({cfg.gammas[len(cfg.gammas) // 2]} | ({cfg.gammas[0]} if cfg.probe_two_windows else set()))
    e = layers[len(layers) // 2]
    return [Config("ar")] + [Config("sd", gamma=g) for g in gs] + [Config("mirror", cfg.kappas[0], g, e) for g in gs]


def measure_overheads(pipe: Any, t: Timings, probes: list[Config], cfg: TuneConfig, prompts,
                      check: Callable[[], None] = lambda: None) -> dict:
    """Per mode and probed γ: measured step time minus the modelled components (scheduling, messages,
    sampling, Python; negative where a component timed alone costs more than inside a real step).

    The probes run for real on the first prompt; returns their runs (the confirmation adds the other
    prompts to them; their prediction is fitted to them: the table marks them).
    """
    runs = run_configs(pipe, probes, prompts[:1], cfg.max_tokens, check=check, min_seconds=cfg.min_seconds / 2)
    fit_overheads(t, runs)
    return runs


def fit_overheads(t: Timings, runs: dict) -> None:
    """t.overhead[mode][γ] from real runs of probe configurations: step time minus the modelled components."""
    for c, run in runs.items():
        t.overhead.setdefault(c.mode, {})[c.gamma or 0] = run["step_s"] - component_time(c, t, run["reuse"])


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


def calibrate(pipe: Any, cfg: TuneConfig = TuneConfig(), prompts_file: Optional[str] = None,
              log: Callable[[str], None] = lambda s: None) -> profiles.Profile:
    """Measure, predict, confirm; the profile (not yet saved) with the fastest measured configuration."""
    from tqdm import tqdm

    if pipe.draft is None:
        raise ValueError("tune needs a draft model (without one the only mode is ar): pass --draft-model")
    if pipe.engine.host is None:
        raise RuntimeError(f"the draft was dropped earlier ({pipe.engine.draft_failure})")
    started = time.perf_counter()

    def check() -> None:
        if cfg.budget_s is not None and time.perf_counter() - started > cfg.budget_s:
            raise OutOfTime(f"calibration passed its {cfg.budget_s:g} s budget")

    prompts = calibration_prompts(pipe, cfg.prompts, prompts_file)
    layers = exit_layer_candidates(pipe, cfg)
    configs = grid(cfg.kappas, cfg.gammas, layers)
    probes = probe_configs(cfg, layers)
    top = max(cfg.confirm, cfg.exact_top)  # the predictions that decide what is confirmed are all measured ones
    total = (len(prompts) + len({1} | {g + 1 for g in cfg.gammas}) + len(cfg.gammas) * (1 + len(cfg.kappas))
             + len(cfg.gammas) * len(layers) + 1 + len(probes) + top + cfg.confirm)  # the parallel points: a guess
    bar = tqdm(total=total, desc="tune", unit="step", disable=not cfg.progress, file=sys.stderr, dynamic_ncols=True)
    phases: dict[str, float] = {}
    lap = [time.perf_counter()]

    def tick() -> None:
        bar.update(1)
        check()

    def done(phase: str) -> None:
        now = time.perf_counter()
        phases[phase] = now - lap[0]
        lap[0] = now

    try:
        traces = []
        with pipe._lock:  # direct use of the target and the host: no generation of another thread meanwhile
            for p, text in zip(prompts, greedy_texts(pipe, prompts, cfg.max_tokens)):
                traces.append(trace(pipe, p, cfg.max_tokens, layers, max(cfg.gammas), text=text))
                tick()
            acc = Acceptance([tr for tr, _ in traces])
            done("traces")
            bench = _Bench(pipe, traces[0][1])  # over a prompt and its greedy text
            t = measure_timings(pipe, bench, cfg, layers, tick)
        mirror_probes = [c for c in probes if c.mode == "mirror"]
        measure_parallel(pipe, bench, t, mirror_probes, acc, len(mirror_probes), cfg.reps, tick, cfg.min_timed_s)
        done("timings")
        probe_runs = measure_overheads(pipe, t, probes, cfg, prompts, check)
        for _ in probes:
            tick()
        done("probes")
        n_parallel = measure_parallel(pipe, bench, t, configs, acc, top, cfg.reps, tick, cfg.min_timed_s)
        done("parallel")
        ranked = rank(configs, t, acc)
        # The top predictions and ar, on the first few prompts: probes among them add the other prompts
        # to their runs on the first; the probes outside stay measured on one prompt and are not candidates.
        confirm = pick_confirm(ranked, cfg.confirm)
        confirm += [Config("ar")] if Config("ar") not in confirm else []
        measured = {c: r for c, r in probe_runs.items()}
        own = {c: prompts[1 if c in probes else 0: cfg.confirm_prompts] for c in confirm}
        measured.update(run_configs(pipe, confirm, own, cfg.max_tokens, warm_up=False, check=check,
                                    min_seconds=cfg.min_seconds, sums={c: r["sums"] for c, r in probe_runs.items()}))
        bar.update(cfg.confirm)
        # The probes' overheads again from all their runs, the confirmation's too: on a ms-scale pair the
        # machine's speed moves 10-20 % between the probe runs and the confirmation seconds later, and a
        # fit to twice the runs follows the calibration's whole span (the table's predictions use it).
        fit_overheads(t, {c: measured[c] for c in probes})
        n_parallel += measure_parallel(pipe, bench, t, configs, acc, top, cfg.reps, tick, cfg.min_timed_s)
        ranked = rank(configs, t, acc)
        done("confirm")
    finally:
        bar.close()
    counts = {g: acc.window_counts(g) for g in cfg.gammas}
    table = [dict(asdict(r["config"]), predicted=r["tokens_per_second"],
                  measured=measured[r["config"]]["tokens_per_second"] if r["config"] in measured else None,
                  measured_step_ms=1e3 * measured[r["config"]]["step_s"] if r["config"] in measured else None,
                  probe=r["config"] in probes, confirmed=r["config"] in confirm, bound=r["bound"],
                  tokens_per_step=r["tokens_per_step"], reuse=r["reuse"], step_ms=1e3 * r["step_s"]) for r in ranked]
    best, ar, margin = choose(table)
    c = row_config(best)
    why = (f"tuned: {expected_rate(best):.0f} tok/s expected vs ar {expected_rate(ar):.0f}"
           f" (measured {best['measured']:.0f}, predicted {best['predicted']:.0f}; best of {len(confirm)} confirmed, "
           f"{len(configs)} predicted{margin})")
    calibration = {"seconds": time.perf_counter() - started, "phases": phases, "prompts": len(prompts),
                   "max_tokens": cfg.max_tokens, "parallel_measured": n_parallel,
                   "acceptance": {str(g): list(v) for g, v in counts.items()},  # γ: [accepted, rejections]
                   "timings": {k: {str(kk): v for kk, v in d.items()} for k, d in asdict(t).items()}}
    log(f"calibrated in {calibration['seconds']:.1f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items()) + ")")
    return profiles.Profile(key=pipe_key(pipe), mode=c.mode, kappa=c.kappa, gamma=c.gamma, exit_layer=c.exit_layer,
                            why=why, table=table, calibration=calibration)


# --- mode="auto" ----------------------------------------------------------------------------------


def pipe_key(pipe: Any) -> dict:
    key = getattr(pipe, "_profile_key", None)
    if key is None:
        key = pipe._profile_key = profiles.key_for(pipe.model, pipe.draft, pipe.engine.exit_adapter)
    return key


_calibrating = threading.Lock()  # two threads' first auto calls calibrate once, not twice at once


def profile_for(pipe: Any) -> profiles.Profile:
    """The pipeline's profile: in memory, else on disk, else a quick calibration (one line on stderr)."""
    prof = getattr(pipe, "_profile", None)
    if prof is not None:
        return prof
    with _calibrating:
        return _load_or_calibrate(pipe)


def _load_or_calibrate(pipe: Any) -> profiles.Profile:
    prof = getattr(pipe, "_profile", None)
    if prof is not None:
        return prof
    key = pipe_key(pipe)
    try:
        prof = profiles.load(key, pipe.engine)
    except profiles.ProfileError as e:
        print(f"mirror-mlx: {e}; recalibrating", file=sys.stderr)
        prof = None
    if prof is None:
        t0 = time.perf_counter()
        cfg = TuneConfig.quick()
        try:
            prof = calibrate(pipe, cfg)
        except OutOfTime:  # the safe rule: plain generation is never slower than itself
            prof = profiles.Profile(key=key, mode="ar", why=(
                f"quick calibration ran out of its {cfg.budget_s:g} s budget (MIRROR_MLX_QUICK_BUDGET), "
                "so ar, the safe rule"))
            print(f"mirror-mlx: mode auto: {prof.why}; not saved (`mirror-mlx tune` measures without a budget)",
                  file=sys.stderr)
        except Exception as e:  # a draft that fails here would fail in generation too: plain, visibly
            prof = profiles.Profile(key=key, mode="ar", why=f"quick calibration failed ({e!r}), so ar")
            print(f"mirror-mlx: warning: mode auto: {prof.why}; not saved", file=sys.stderr)
        else:
            prof.why = "quick " + prof.why
            try:
                saved = f"saved {profiles.save(prof)}"
            except profiles.ProfileError as e:  # an unwritable cache: this process keeps it in memory
                saved = f"warning: {e}"
            print(f"mirror-mlx: mode auto: no tuning profile for this pair, quick calibration "
                  f"({time.perf_counter() - t0:.1f} s) chose {describe(prof)}; {saved} "
                  "(`mirror-mlx tune` measures more)", file=sys.stderr)
    pipe._profile = prof
    return prof


def row_config(row: dict) -> Config:
    return Config(row["mode"], row["kappa"], row["gamma"], row["exit_layer"])


def describe(c: Any) -> str:
    return Config(c.mode, c.kappa if c.mode == "mirror" else None, c.gamma if c.mode != "ar" else None,
                  c.exit_layer if c.mode == "mirror" else None).name


def pooled_ratio(counts: list[tuple[float, int, int]], prior_weight: int) -> tuple[float, int]:
    """(the weighted mean of seen / expected, how many seen): `counts` holds (expected rate, hits, misses)
    per group; each group's rate is pooled with its expected one, which weighs as `prior_weight` hits and
    misses (the user's text need not be like the calibration's, so it soon outweighs it)."""
    num = n = 0
    for expected, hits, misses in counts:
        if expected <= 0 or not hits + misses:
            continue
        pooled = (expected * prior_weight + hits) / (prior_weight + hits + misses)
        num += (hits + misses) * pooled / expected
        n += hits + misses
    return (num / n if n else 1.0), n


def observed(prof: profiles.Profile, seen: dict[tuple, list[int]], prior_tokens: int = PRIOR_TOKENS,
             prior_steps: int = PRIOR_STEPS) -> Optional[Seen]:
    """`Seen` from auto's runs at one sampling setting (Engine.auto_seen[setting]): per γ, the draft's α
    (accepted / (accepted + rejections)) against the calibration traces replayed at that γ (pooled with
    them at PRIOR_TOKENS); per Mirror-SD configuration, its branch reuse against the table's prediction
    (pooled at PRIOR_STEPS). None before anything was seen, or for a profile without acceptance counts
    (a quick one that fell back to ar)."""
    prior = prof.calibration.get("acceptance")
    if not prior or not seen:
        return None
    alphas = {int(g): a / max(a + r, 1) for g, (a, r) in prior.items()}
    per_gamma: dict[int, list[int]] = {}
    for (_, _, g, _), (a, r, *_) in seen.items():
        per_gamma.setdefault(g, [0, 0])
        per_gamma[g][0] += a
        per_gamma[g][1] += r
    acceptance, tokens = pooled_ratio([(alphas.get(g, 0.0), a, r) for g, (a, r) in per_gamma.items()],
                                      prior_tokens)
    rows = {(r["mode"], r["kappa"], r["gamma"], r["exit_layer"]): r for r in prof.table}
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
                  best["exit_layer"], why)


def leave_draft(prof: profiles.Profile, c: Choice) -> Optional[Callable[[list], Optional[str]]]:
    """For auto's speculative choice `c`: a test the engine runs after each step of a generation with this
    generation's counts [accepted, rejections, reuses, fallbacks]. It says why to go on with ar once
    the text at hand (its counts pooled with the calibration's at WITHIN_PRIOR_*) makes ar's measured rate
    AR_MARGIN above the choice's (`expected_rate`); `adapt` learns across generations, this within one.
    None where there is nothing to compare (ar, no confirmed row for `c`, a profile without counts)."""
    rows = [r for r in prof.table if r.get("confirmed") and r.get("measured_step_ms")]
    here = next((r for r in rows if r["mode"] != "ar" and describe(row_config(r)) == describe(c)), None)
    ar = next((r for r in rows if r["mode"] == "ar"), None)
    if c.mode == "ar" or here is None or ar is None or not prof.calibration.get("acceptance"):
        return None
    config = (c.mode, c.kappa if c.mode == "mirror" else None, c.gamma, c.exit_layer if c.mode == "mirror" else None)

    def test(counts: list) -> Optional[str]:
        if counts[0] + counts[1] < WITHIN_MIN_JUDGED:
            return None
        s = observed(prof, {config: counts}, WITHIN_PRIOR_TOKENS, WITHIN_PRIOR_STEPS)
        rate, plain = expected_rate(here, s), expected_rate(ar, s)
        if plain < AR_MARGIN * rate:
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


def resolve(pipe: Any, mode: str, kappa: Optional[int], gamma: Optional[int], exit_layer: Optional[int],
            sampling: Optional[tuple] = None) -> Choice:
    """A concrete mode and knobs. Explicit values always win; mode="auto" fills the rest from the profile,
    adapted to what auto's runs at the same `sampling` setting (DecodeOptions.sampling) have seen (`adapt`)."""

    def knobs(k: Optional[int], g: Optional[int], e: Optional[int], why: str, m: str = "mirror") -> Choice:
        return Choice(m, PAPER_KNOBS["kappa"] if k is None else k, PAPER_KNOBS["gamma"] if g is None else g, e, why)

    if mode != "auto":
        return knobs(kappa, gamma, exit_layer, f"mode {mode} as asked", mode)
    if pipe.draft is None:
        return knobs(kappa, gamma, exit_layer, "auto: no draft model, so ar", "ar")
    if kappa is not None and gamma is not None:  # Mirror-SD fully asked for: nothing to look up
        return knobs(kappa, gamma, exit_layer, "auto with kappa and gamma given: mirror with them")
    prof = profile_for(pipe)
    asked = {k: v for k, v in dict(kappa=kappa, gamma=gamma, exit_layer=exit_layer).items() if v is not None}
    if not asked:
        # a copy (dict() is one step under the GIL): a generation on another thread may add to it meanwhile
        seen = {c: list(v) for c, v in dict(pipe.engine.auto_seen.get(sampling) or {}).items()} \
            if sampling is not None else None
        adapted = adapt(prof, seen, setting_name(sampling)) if seen else None
        if adapted is not None:
            c = replace(adapted, why="auto: " + adapted.why)
        else:
            c = knobs(prof.kappa, prof.gamma, prof.exit_layer, "auto: " + prof.why, prof.mode)
        return replace(c, leave_draft=leave_draft(prof, c))
    # Explicit knobs: the best row of the profile's table that has them (κ or ℓ_e imply mirror).
    need = "mirror" if {"kappa", "exit_layer"} & asked.keys() else None
    rows = [r for r in prof.table if r["mode"] != "ar" and (need is None or r["mode"] == need)
            and all(r.get(k) == v for k, v in asked.items())]
    if not rows:
        return knobs(kappa, gamma, exit_layer, "auto with knobs outside the profile's grid: mirror with them")
    r = max(rows, key=lambda r: r["measured"] if r.get("measured") is not None else r["predicted"])
    why = "auto with " + ", ".join(f"{k}={v}" for k, v in asked.items()) + ": best such point in the profile"
    return knobs(r["kappa"] if kappa is None else kappa, r["gamma"] if gamma is None else gamma,
                 r["exit_layer"] if exit_layer is None else exit_layer, why, r["mode"])


# --- reporting ------------------------------------------------------------------------------------


def format_table(prof: profiles.Profile, top: int = 10) -> str:
    """Predicted vs measured tokens/s: the top predictions and every measured configuration."""
    rows = [r for i, r in enumerate(prof.table) if i < top or r.get("measured") is not None]
    lines = [f"{'configuration':<38} {'tok/step':>8} {'reuse':>6} {'step ms':>8} {'predicted':>10} {'measured':>9} "
             f"{'error':>7}"]
    for r in rows:
        m = r.get("measured")
        err = f"{100 * (r['predicted'] - m) / m:+.0f}%" if m else ""
        note = " (probe)" if r.get("confirmed", True) else " (probe, 1 prompt)"
        name = describe(Config(r["mode"], r["kappa"], r["gamma"], r["exit_layer"])) + (note if r.get("probe") else "")
        predicted = ("≤" if r.get("bound") else "") + f"{r['predicted']:.1f}"  # ≤: suffix ‖ rollout not measured
        lines.append(f"{name:<38} {r['tokens_per_step']:>8.2f} {100 * r['reuse']:>5.0f}% {r['step_ms']:>8.2f} "
                     f"{predicted:>10} {m if m is not None else float('nan'):>9.1f} {err:>7}")
    return "\n".join(lines)


def acceptance_line(prof: profiles.Profile) -> str:
    """The calibration's draft acceptance per γ, as `stats.acceptance_rate` reads it (what auto adapts from)."""
    acc = prof.calibration.get("acceptance") or {}
    return ("draft acceptance α per γ on the calibration text (auto compares stats.acceptance_rate with it): "
            + ", ".join(f"γ={g} {a / max(a + r, 1):.2f}" for g, (a, r) in acc.items())) if acc else ""


def contention(prof: profiles.Profile) -> str:
    """For the chosen mirror point: suffix ‖ rollout measured together against Eq. 10's ideal max()."""
    if prof.mode != "mirror":
        return ""
    t = prof.calibration["timings"]
    k, g, e = prof.kappa, prof.gamma, prof.exit_layer
    suffix = t["suffix"][str((e, g + 1))]
    rollout = t["rollout"][str((k * (g + 1), g))]
    together = t["parallel"].get(str((e, k, g)))
    if together is None:  # chosen from its real runs; its prediction used the floor (confirmed past the top: pick_confirm)
        return (f"suffix ‖ rollout at κ={k} γ={g} ℓe={e}: not timed together (confirmed by its real runs); "
                f"max({1e3 * suffix:.2f}, {1e3 * rollout:.2f}) ms apart")
    return (f"suffix ‖ rollout at κ={k} γ={g} ℓe={e}: {1e3 * together:.2f} ms together vs "
            f"max({1e3 * suffix:.2f}, {1e3 * rollout:.2f}) ms apart ({together / max(suffix, rollout):.2f}× the ideal)")
