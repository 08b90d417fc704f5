"""Calibrate the cost model on this machine and pick the fastest mode and knobs (`mirror-mlx tune`,
and mode auto's first call).

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

Across ranks (mirror_mlx/distributed.py, under mlx.launch) every rank runs the same target forwards in the
same order (its shard's layers all_sum inside each), so whatever a timing decides (repetitions, the points
measured next, the configurations confirmed, when a real run has run long enough) is rank 0's decision,
shared (`Lockstep`); the draft lives beside rank 0 and is timed there alone; T_comm (the collectives per
target forward, by row count) is measured and kept apart in the step model; rank 0 alone gets the profile.
"""

import os
import random
import statistics
import sys
import time
import zlib
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any, Callable, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

from ..drafts.mlx_draft import MLXDraft
from ..exit_adapter import adapter_for, adapter_layers
from ..options import DRAFT_TIMEOUT_S
from ..model_parts import trimmable_cache
from ..target import EarlyExitTarget, top_k
from . import profile as profiles
from .profile import PairView
from .choose import choose, expected_rate, row_config
from .cost_model import Acceptance, Config, Timings, Trace, component_time, grid, rank
from .placement import candidates

CALIBRATION_POOL = 40  # tune's prompts come from the last this-many held-out openings
QUICK_BUDGET_S = 30.0  # the first-call calibration's cap (MIRROR_MLX_QUICK_BUDGET overrides); then ar
# Each piece is timed at least `reps` times and at least `min_timed_s` (MIN_TIMED_S; the quick calibration
# 0.15 s): a ms-scale piece's speed moves by 10-30 % from one tenth of a second to the next on a shared
# machine (a piece of 100 ms or more costs no extra time).
MIN_TIMED_S = 0.3
MAX_REPS = 100


class OutOfTime(RuntimeError):
    """The calibration's time budget ran out."""


class Lockstep:
    """Who decides. In one process every decision is this process's own; across ranks (a pipeline with a
    `group`) rank 0's, shared with the others (one small all_sum), so every rank runs the same forwards."""

    def __init__(self, pipe: PairView):
        self.pipe = pipe
        self.group = getattr(pipe, "group", None)
        self.lead = self.group is None or self.group.rank() == 0

    def ints(self, values: Sequence[int], size: int) -> list[int]:
        """Rank 0's `values` (at most `size`, padded with 0) on every rank."""
        if self.group is None:
            return list(values) + [0] * (size - len(values))
        return self.pipe.agree(values, size, "rank 0's calibration")

    def flags(self, flags: Sequence[bool]) -> list[bool]:
        return [bool(f) for f in self.ints([int(f) for f in flags], len(flags))]

    def pick(self, chosen: Optional[Sequence[Config]], among: Sequence[Config]) -> list[Config]:
        """Rank 0's `chosen` (configurations of `among`, the same list on every rank) on every rank."""
        got = self.ints([len(chosen), *(among.index(c) for c in chosen)] if self.lead else [], len(among) + 1)
        return [among[i] for i in got[1 : 1 + got[0]]]


def local_host(engine: Any) -> Any:
    """The draft host this process times alone: the engine's; across ranks rank 0's own (timing the draft
    needs no other rank), None on the other ranks (the draft lives beside rank 0)."""
    return engine.draft_host  # (a rank's stand-in names its own: distributed/shared_draft.py)


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
    branches: tuple = (None, 2, 4, 8)  # mirror's branch budgets B (each below κ(γ+1)): predicted from the traces
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
        """Small on purpose: 2 openings × 16 tokens (1 to confirm), κ ∈ {1,2} × γ ∈ {1,...,5}, the middle ℓ_e
        (and each exit adapter's first exact layer), one probe per mode, capped."""
        return cls(prompts=2, max_tokens=16, kappas=(1, 2), gammas=(1, 2, 3, 4, 5), branches=(None, 2, 4), reps=2, confirm=2,
                   confirm_prompts=1, min_seconds=0.5, min_timed_s=0.15, probe_two_windows=False, exact_top=2,
                   progress=False, budget_s=quick_budget())


# --- the calibration prompts ----------------------------------------------------------------------


def calibration_prompts(pipe: PairView, n: int, path: Optional[str] = None) -> list[list[int]]:
    """Token ids of `n` prompts: the user's file (prompts.load_prompts) or n of the *last* 40 held-out
    TinyStories openings (benchmarks take theirs from the front, so a tuned profile has never seen a
    bench prompt), as many as can be of one token length: prompts of one length share each target
    forward of the traces' greedy texts (corpus.greedy_continuations batches them). Whole openings, not
    cut ones: a cut opening's greedy text is less predictable (γ=3 accepted 2.18 tokens a step on
    openings cut to 13 tokens, 2.43 whole). A chat model (a tokenizer with a chat template) is tuned on
    Spec-Bench's training part instead, through its template (prompts.chat_calibration): the bench
    evaluates on the other part."""
    from ..prompts import chat_calibration, load_prompts
    from ..text import has_chat_template

    if path:
        return [pipe.encode(p.text) for p in load_prompts(path, n)]
    if has_chat_template(getattr(pipe, "tokenizer", None)):
        return [pipe.encode(p.text) for p in chat_calibration(n)]
    from ..corpus import load_split

    pool = [pipe.encode(t) for t in reversed(load_split().held_out[-CALIBRATION_POOL:])]  # last first
    by_len: dict[int, list] = {}
    for ids in pool:
        by_len.setdefault(len(ids), []).append(ids)
    common = max(by_len, key=lambda k: (min(len(by_len[k]), n), k))  # the length most of them share
    same = by_len[common][:n]
    return same + [ids for ids in pool if len(ids) != common][: n - len(same)]


# --- 1. acceptance traces -------------------------------------------------------------------------


def exit_layer_candidates(pipe: PairView, cfg: TuneConfig) -> list[int]:
    n = pipe.engine.n_layers
    quick = cfg.budget_s is not None and cfg.exit_layers is None  # the capped calibration: N/2 and the adapters' layers
    layers = cfg.exit_layers or ((n // 2,) if quick else (n // 4, n // 3, n // 2, 3 * n // 4))
    covered = adapter_layers(pipe.engine.exit_adapter)
    if covered and quick:  # and each adapter's shallowest exact layer: its state with the fewest layers to it
        ad = pipe.engine.exit_adapter
        layers = (*layers, *{min(e for e in covered if adapter_for(ad, e) is adapter_for(ad, c)) for c in covered})
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


def plain_draft_model(pipe: PairView) -> Optional[Any]:
    """The draft as a plain MLX model in this process, for the teacher-forced trace: the MLXDraft object
    itself, or for `load()`'s recipe of a plain mlx-lm draft (it lives in the host process) a copy loaded
    here (small; one forward per prompt instead of one host rollout per position). None for other drafts
    (SS drafts propose more than argmax chains, Core ML runs elsewhere): the trace then uses host rollouts."""
    from ..drafts.recipes import DraftRecipe, mlx_draft, mlx_draft_model

    draft = getattr(pipe, "draft", None)
    if isinstance(draft, DraftRecipe) and draft.build is mlx_draft:
        return mlx_draft_model(*draft.args)
    return draft.model if type(draft) is MLXDraft else None  # subclasses (SS) propose more than argmax chains


def greedy_texts(pipe: PairView, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The target's greedy continuation of each prompt (prompts of one length share each forward)."""
    from ..corpus import greedy_continuations

    eos = tuple(getattr(pipe.tokenizer, "eos_token_ids", ()) or ())
    return pipe.engine.on_target(partial(greedy_continuations, pipe.model, prompts,
                                                  max_tokens, eos=eos))


def trace(pipe: PairView, prompt: list[int], max_tokens: int, exit_layers: Sequence[int], gamma_max: int,
          draft_model: Any = "auto", text: Optional[list[int]] = None) -> tuple[Trace, list[int]]:
    """The acceptance trace of one prompt (cost_model.Trace) from real forwards of both models, and
    the prompt plus the target's greedy text (`text`, else generated here).

    The draft side: one teacher-forced forward of `draft_model` ("auto": `plain_draft_model(pipe)`),
    else (None) one blocking rollout per position through the draft host. Across ranks the draft side
    runs on rank 0 alone; the other ranks run the target's forwards only (their trace is not used).
    """
    engine = pipe.engine
    host = local_host(engine)
    if draft_model == "auto":
        draft_model = plain_draft_model(pipe) if host is not None else None
    if text is None:
        text = greedy_texts(pipe, [prompt], max_tokens)[0]
    full = list(prompt) + text
    n0 = len(prompt)

    def draft_runs() -> tuple[list[int], list[int]]:
        runs, first = [], []
        for i in range(n0, len(full)):
            w = host.rollout(full[: i - 1], [[full[i - 1]]], gamma_max, timeout=DRAFT_TIMEOUT_S).windows[0]
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

    if host is None:  # a rank beside rank 0: the early exit's forwards below, nothing of the draft
        runs, first = [0] * len(text), list(text)
    else:
        runs, first = engine.on_target(teacher_forced) if draft_model is not None else draft_runs()
    tr = Trace(runs=runs)

    def ranks(layer: int) -> tuple[list[int], list[int]]:
        tapped = EarlyExitTarget(pipe.model, layer, adapter_for(engine.exit_adapter, layer))
        try:
            early, _ = tapped.forward(mx.array([full[:-1]]), cache=None)
            return _ranks(early[0, n0 - 1:], text, first)
        finally:
            tapped.remove()

    for layer in exit_layers:
        tr.rank_excl[layer], tr.rank_plain[layer] = engine.on_target(ranks, layer)
    return tr, full


# --- 2. component timings -------------------------------------------------------------------------


def interleaved(pieces: dict, reps: int, tick: Callable = lambda: None, min_s: float = MIN_TIMED_S,
                step: Optional[Lockstep] = None) -> dict:
    """{key: median seconds} of pieces timed in rounds, one call of each per round: a burst of load on a
    shared machine then hits every piece alike, not the few timed during it (and the median of at least
    `reps` drops a slow first call). Each piece returns its own seconds (or a tuple of them, medians
    taken per element). `step`: pieces that run target forwards across ranks stop when rank 0's do."""
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
        if step is not None and step.group is not None:
            done = [k for k, f in zip(todo, step.flags([k in done for k in todo])) if f]
        for _ in done:
            tick()
        todo = [k for k in todo if k not in done]
    return {k: tuple(map(statistics.median, zip(*ts))) if isinstance(ts[0], tuple) else statistics.median(ts)
            for k, ts in times.items()}


class _Bench:
    """Timed pieces over one committed context, each on the worker that runs it in the engine; each
    method times one call and returns its seconds (`interleaved` repeats them)."""

    def __init__(self, pipe: PairView, context: list[int]):
        self.engine, self.model, self.context = pipe.engine, pipe.model, context
        self.draft = local_host(self.engine)  # None on a rank beside rank 0: the target's pieces only
        self.cache = self.engine.on_target(self._prefill)

    def _prefill(self):
        cache = trimmable_cache(self.model)
        self.model(mx.array([self.context[:-1]]), cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    def rows(self, n: int) -> mx.array:
        return mx.array([self.context[-n:] if n <= len(self.context) else [self.context[-1]] * n])

    def verify(self, n: int) -> float:
        """A plain target forward over `n` rows."""

        def once():
            t0 = time.perf_counter()
            mx.eval(self.model(self.rows(n), cache=self.cache))
            elapsed = time.perf_counter() - t0
            trim_prompt_cache(self.cache, n)
            return elapsed

        return self.engine.on_target(once)

    def split(self, layer: int, n: int) -> tuple[float, float]:
        """(prefix, suffix) seconds at exit layer `layer` over `n` rows."""

        def once():
            tapped = EarlyExitTarget(self.model, layer, adapter_for(self.engine.exit_adapter, layer))
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

        return self.engine.on_target(once)

    def comm(self, n: int, group: Any) -> float:
        """T_comm over `n` rows across ranks: the collectives of one forward of the sharded target (two
        all_sums of n × hidden per layer), chained in one graph as the forward chains them (an eval after
        each would time MLX's per-eval overhead too), on the target's worker. Every rank must call it."""
        from ..model_parts import text_model

        inner = text_model(self.model)
        norm = getattr(getattr(inner, "norm", None), "weight", None)  # the activations' dtype
        dtype = norm.dtype if norm is not None else mx.float32

        def once() -> float:
            x = mx.zeros((n, inner.args.hidden_size), dtype=dtype)
            mx.eval(x)
            t0 = time.perf_counter()
            for _ in range(2 * len(inner.layers)):
                x = mx.distributed.all_sum(x, group=group, stream=mx.cpu)
            mx.eval(x)
            return time.perf_counter() - t0

        return self.engine.on_target(once)

    def stems(self, kappa: int, gamma: int) -> list[list[int]]:
        spine = self.context[-gamma:]
        vocab = self.engine.draft_vocab
        return [spine[:r] + [(self.context[-1] + 1 + v) % vocab] for r in range(gamma + 1) for v in range(kappa)]

    def sync(self, context: list[int]) -> None:
        """The host's draft cache at `context` (a real step's draft has the committed text synced in)."""
        self.draft.post_sync(context)
        self.draft.wait_done(DRAFT_TIMEOUT_S)

    def rollout(self, stems: list[list[int]], gamma: int, prepared: Optional[bool] = None) -> float:
        """A blocking host rollout after two newly committed tokens (they reach the draft with the request,
        as in a real step): the round trip over the ring, what the scheduler waits for. Branches (or
        `prepared`) follow a prepare, as in a mirror step (the window fed during the prefix: `prepare`)."""
        self._ready(gamma, len(stems) > 1 if prepared is None else prepared)
        ctx = self.context[:-1]
        t0 = time.perf_counter()
        self.draft.rollout(ctx, stems, gamma, timeout=DRAFT_TIMEOUT_S)
        return time.perf_counter() - t0

    def _ready(self, gamma: int, prepared: bool) -> None:
        """The draft as a real step has it before its rollout: two committed tokens behind, or (prepared)
        holding the committed tokens and the γ-token window `stems` branch from (mirror's prepare)."""
        ctx = self.context[:-1]
        self.sync(ctx + self.context[-gamma:] if prepared else ctx[:-2])

    def prepare(self, gamma: int) -> float:
        """Mirror's prepare after two newly committed tokens: the draft feeds them and the γ-token window
        (beside the target's prefix in a real step)."""
        ctx = self.context[:-1]
        self.sync(ctx[:-2])
        t0 = time.perf_counter()
        self.sync(ctx + self.context[-gamma:])
        return time.perf_counter() - t0

    def local_rollout(self, gamma: int) -> float:
        """sd's window where it drafts in-process: on the target's thread, after two newly committed
        tokens, as in a real sd step (no ring)."""
        return self.engine.local_window(self.context[:-1], self.context[-1], gamma)

    def parallel(self, layer: int, kappa: int, gamma: int) -> float:
        """The target suffix (on the target's worker) and the κ(γ+1)-row host rollout posted together;
        seconds until both are done."""
        engine, ctx, n = self.engine, self.context[:-1], gamma + 1

        def prefix():
            tapped = EarlyExitTarget(self.model, layer, adapter_for(engine.exit_adapter, layer))
            early, final = tapped.forward(self.rows(n), self.cache)
            mx.eval(early)
            tapped.remove()
            return final

        final = engine.on_target(prefix)
        if self.draft is not None:
            self._ready(gamma, True)
        t0 = time.perf_counter()
        suffix = engine.submit_on_target(mx.eval, final)
        if self.draft is not None:  # awaited while the suffix runs
            self.draft.rollout(ctx, self.stems(kappa, gamma), gamma, timeout=DRAFT_TIMEOUT_S)
        suffix.result()
        elapsed = time.perf_counter() - t0
        engine.on_target(trim_prompt_cache, self.cache, n)
        return elapsed


def measure_timings(pipe: PairView, b: _Bench, cfg: TuneConfig, layers: list[int], tick: Callable,
                    step: Optional[Lockstep] = None) -> Timings:
    """Every component but suffix ‖ rollout together (`measure_parallel` does those where they matter).
    Across ranks (`step`) the target's pieces run on every rank as rank 0 decides, the draft's on rank 0
    alone, and T_comm is timed in the same rounds as the verify forwards (a burst of load hits both alike),
    then split off the target's pieces (`split_comm`)."""
    step = step or Lockstep(None)
    t = Timings()
    timed = partial(interleaved, reps=cfg.reps, tick=tick, min_s=cfg.min_timed_s)
    rows = sorted({1} | {g + 1 for g in cfg.gammas})
    if step.group is None:
        t.verify = timed({n: partial(b.verify, n) for n in rows})
    else:
        both = timed({**{("verify", n): partial(b.verify, n) for n in rows},
                      **{("comm", n): partial(b.comm, n, step.group) for n in rows}}, step=step)
        t.verify = {n: both[("verify", n)] for n in rows}
    if b.draft is not None:  # the draft: in this process, or across ranks beside rank 0 only
        t.window = timed({g: partial(b.rollout, [[b.context[-1]]], g) for g in cfg.gammas})
        if pipe.engine.drafts_locally:  # sd drafts in-process: its window as it runs
            t.local_window = timed({g: partial(b.local_rollout, g) for g in cfg.gammas})
        # the rollout alone does not depend on ℓ_e
        t.rollout = timed({(k * (g + 1), g): partial(b.rollout, b.stems(k, g), g)
                           for g in cfg.gammas for k in cfg.kappas})
        t.prepare = timed({g: partial(b.prepare, g) for g in cfg.gammas})
    halves = timed({(layer, g + 1): partial(b.split, layer, g + 1) for layer in layers for g in cfg.gammas}, step=step)
    t.prefix = {k: v[0] for k, v in halves.items()}
    t.suffix = {k: v[1] for k, v in halves.items()}
    if step.group is not None:
        split_comm(t, {n: both[("comm", n)] for n in rows}, pipe.engine.n_layers)
    return t


def split_comm(t: Timings, comm: dict, n_layers: int) -> None:
    """T_comm by row count (`comm`, one whole forward's collectives, `_Bench.comm`) into the step model: each
    target piece was timed across ranks with its collectives in it, so its compute alone is kept (the piece
    minus its share of T_comm: ℓ_e of the N layers' for a prefix, the rest for a suffix) and cost_model adds
    T_comm back once per forward. The predictions stay those of the measured pieces; T_comm is a term of its
    own (what another link would change). Under load a piece's compute can come out below 0, as an overhead
    can (cost_model.Timings): the sum is still the measured piece."""
    t.comm = dict(comm)
    t.comm_prefix = {(e, n): comm[n] * e / n_layers for e, n in t.prefix}
    t.verify = {n: v - comm[n] for n, v in t.verify.items()}
    t.prefix = {(e, n): v - t.comm_prefix[(e, n)] for (e, n), v in t.prefix.items()}
    t.suffix = {(e, n): v - (comm[n] - t.comm_prefix[(e, n)]) for (e, n), v in t.suffix.items()}


def measure_parallel(pipe: PairView, b: _Bench, t: Timings, configs: list[Config], acc: Acceptance, top: int,
                     reps: int, tick: Callable, min_s: float = MIN_TIMED_S, step: Optional[Lockstep] = None) -> int:
    """Measure suffix ‖ rollout at the mirror points that can reach the `top` best predictions.

    Unmeasured points are predicted at their floor (cost_model.parallel_time), an upper bound; each round
    measures the unmeasured points among the current top, until the top is all measured. Then no
    unmeasured point can be in it (its bound is below the top's last), so the top equals what measuring
    every point would give, at a fraction of the time. Returns how many points were measured.

    A round after the first times the first point measured beside its new ones, and puts them on that
    point's scale (its first time / its time now): the points are compared with one another, and a
    ms-scale pair's speed moves 10-30 % between rounds seconds apart.

    Across ranks (`step`) rank 0 ranks and says which points to measure (the others hold no draft timings).
    """
    step = step or Lockstep(None)
    measured = 0
    while True:
        todo = [r["config"] for r in rank(configs, t, acc)[:top] if r["bound"]] if step.lead else None
        if step.group is not None:
            todo = step.pick(todo, configs)
        if not todo:
            return measured
        pieces = {(c.exit_layer, c.kappa, c.gamma): partial(b.parallel, c.exit_layer, c.kappa, c.gamma) for c in todo}
        ref = next(iter(t.parallel), None)
        if ref is not None:
            pieces[ref] = partial(b.parallel, *ref)
        with pipe.lock:
            got = interleaved(pieces, reps, tick, min_s, step)
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


def run_configs(pipe: PairView, configs: list[Config], prompts: Union[list[list[int]], dict], max_tokens: int,
                warm_up: Union[bool, Sequence[Config]] = True, check: Callable[[], None] = lambda: None,
                sums: Optional[dict] = None, min_seconds: float = 0.0, step: Optional[Lockstep] = None) -> dict:
    """Real greedy generations of every config on its prompts, interleaved (in rounds: each config runs its
    next prompt, so a load change on a shared machine hits all configs alike). {config: tokens/s, step_s,
    reuse, sums}. `prompts`: one list for all, or {config: its list}; `sums` (a previous call's, per
    config) are added in: runs of other prompts.

    `warm_up`: a short run of every config first (True), of none (False), or of these. Each config runs in
    its own placement (Config.placement, tune/placement.py).

    `min_seconds`: a config's prompts are gone through again until it has decoded this long (a small
    model's 48 tokens take a few ms per token, and single runs of it vary by ±25 % here). Across ranks
    (`step`) rank 0's decode seconds decide it: every rank runs the same generations.
    """
    own = prompts if isinstance(prompts, dict) else {c: prompts for c in configs}
    knobs = {c: dict(mode=c.mode, max_tokens=max_tokens, kappa=c.kappa or 1, gamma=c.gamma or 1,
                     exit_layer=c.exit_layer, branches=c.branches) for c in configs}

    def generate(c: Config, prompt: list[int], **kw: Any) -> Any:
        pipe.auto.placement_forced = c.placement  # each config in its own placement (tune/placement.py)
        try:
            return pipe.generate(prompt, **dict(knobs[c], **kw))
        finally:
            pipe.auto.placement_forced = None

    if warm_up:
        for c in configs if warm_up is True else warm_up:
            check()
            generate(c, own[c][0], max_tokens=4)
    sums = {c: list((sums or {}).get(c, (0, 0, 0, 0.0))) for c in configs}  # tokens, steps, reuses, seconds
    todo, r = [c for c in configs if own[c]], 0
    while todo:
        # each round in its own (seeded) order: whatever a run leaves behind on the machine does not always
        # fall on the same next configuration
        for c in random.Random(r).sample(todo, len(todo)):
            check()
            s = generate(c, own[c][r % len(own[c])]).stats
            for i, v in enumerate((s.generation_tokens, s.steps, s.reuses, s.decode_seconds)):
                sums[c][i] += v
        r += 1
        # a config is done after whole passes over its prompts that add up to min_seconds
        more = [r < len(own[c]) or r % len(own[c]) or sums[c][3] < min_seconds for c in todo]
        if step is not None and step.group is not None:
            more = step.flags(more)
        todo = [c for c, m in zip(todo, more) if m]
    return {c: {"tokens_per_second": tok / sec if sec else 0.0, "step_s": sec / max(steps, 1),
                "reuse": reuses / max(steps, 1), "sums": (tok, steps, reuses, sec)}
            for c, (tok, steps, reuses, sec) in sums.items()}


def probe_configs(cfg: TuneConfig, layers: list[int]) -> list[Config]:
    """Configurations run for real to measure each mode's overhead: ar; sd and mirror at the smallest
    and the middle γ (their overhead grows with the window)."""
    gs = sorted({cfg.gammas[len(cfg.gammas) // 2]} | ({cfg.gammas[0]} if cfg.probe_two_windows else set()))
    e = layers[len(layers) // 2]
    return [Config("ar")] + [Config("sd", gamma=g) for g in gs] + [Config("mirror", cfg.kappas[0], g, e) for g in gs]


def measure_overheads(pipe: PairView, t: Timings, probes: list[Config], cfg: TuneConfig, prompts,
                      check: Callable[[], None] = lambda: None, step: Optional[Lockstep] = None) -> dict:
    """Per mode and probed γ: measured step time minus the modelled components (scheduling, messages,
    sampling, Python; negative where a component timed alone costs more than inside a real step).

    The probes run for real on the first prompt; returns their runs (the confirmation adds the other
    prompts to them; their prediction is fitted to them: the table marks them).
    """
    runs = run_configs(pipe, probes, prompts[:1], cfg.max_tokens, check=check, min_seconds=cfg.min_seconds / 2,
                       step=step)
    if step is None or step.lead:  # (across ranks only rank 0 holds the draft's timings)
        fit_overheads(t, runs)
    return runs


def fit_overheads(t: Timings, runs: dict) -> None:
    """t.overhead[mode][γ] from real runs of probe configurations: step time minus the modelled components."""
    for c, run in runs.items():
        t.overhead.setdefault(c.mode, {})[c.gamma or 0] = run["step_s"] - component_time(c, t, run["reuse"])


def place_row(row: dict, runs: dict) -> None:
    """A table row's placement: where its point was measured in more than one (`runs`: {placement: its run
    or None}), the faster one's run becomes the row's measurement, row["placements"] keeps each one's
    tokens/s. The other rows (and ar and sd, which always run unpinned) say "unpinned"."""
    runs = {p: run for p, run in runs.items() if run is not None}
    row["placement"] = "unpinned"
    if len(runs) < 2:
        return
    row["placements"] = {p: run["tokens_per_second"] for p, run in runs.items()}
    win = max(runs, key=lambda p: runs[p]["tokens_per_second"])
    row["placement"] = win
    row["measured"], row["measured_step_ms"] = runs[win]["tokens_per_second"], 1e3 * runs[win]["step_s"]


def calibrate(pipe: PairView, cfg: TuneConfig = TuneConfig(), prompts_file: Optional[str] = None,
              log: Callable[[str], None] = lambda s: None, key: Optional[dict] = None) -> Optional[profiles.Profile]:
    """Measure, predict, confirm; the profile (not yet saved) with the fastest measured configuration.
    `key`: the pair's profile key (profile.key_for), computed here when not given.

    Across ranks (a DistributedPipeline) every rank must call it: rank 0 returns the profile, the other
    ranks None (they run the target's forwards as rank 0 decides, `Lockstep`)."""
    from tqdm import tqdm

    if pipe.draft is None:
        raise ValueError("tune needs a draft model (without one the only mode is ar): pass --draft-model")
    if not pipe.engine.has_draft:
        raise RuntimeError(f"the draft was dropped earlier ({pipe.engine.draft_failure})")
    step = Lockstep(pipe)
    if step.group is not None and getattr(pipe, "split", "tensor") != "tensor":
        raise ValueError("tune across ranks measures the target split tensor-parallel (every rank runs every "
                         "layer), and this one is split by layers (mlx-lm's pipeline split): give mirror's or sd's "
                         "knobs instead (--kappa, --gamma, --exit-layer)")
    if step.group is not None and cfg.budget_s is not None:  # a budget would end the ranks at different points
        print(f"mirror-mlx: across ranks the calibration has no time budget (the {cfg.budget_s:g} s cap would stop "
              "the ranks at different points): it runs to the end", file=sys.stderr)
    started = time.perf_counter()

    def check() -> None:
        if step.group is None and cfg.budget_s is not None and time.perf_counter() - started > cfg.budget_s:
            raise OutOfTime(f"calibration passed its {cfg.budget_s:g} s budget")

    prompts = calibration_prompts(pipe, cfg.prompts, prompts_file)
    if step.group is not None:  # the same forwards on every rank need the same prompts (a --prompts file per host)
        digest = zlib.crc32(repr(prompts).encode()) & 0x7FFFFFFF
        if step.ints([digest], 1)[0] != digest:
            raise ValueError(f"rank {step.group.rank()}'s calibration prompts differ from rank 0's: --prompts must "
                             "name the same file on every host")
    placements = candidates(pipe)  # mirror's confirmed points run in each (tune/placement.py)
    layers = exit_layer_candidates(pipe, cfg)
    configs = grid(cfg.kappas, cfg.gammas, layers, branches=cfg.branches)
    probes = probe_configs(cfg, layers)
    top = max(cfg.confirm, cfg.exact_top)  # the predictions that decide what is confirmed are all measured ones
    bars: list = []  # one bar per phase, each with its true total (None where the rounds are not known ahead)

    def phase(name: str, total: Optional[int]) -> None:
        if bars:
            bars[-1].close()
        bars.append(tqdm(total=total, desc=f"tune: {name}", unit="step", disable=not cfg.progress, file=sys.stderr,
                         dynamic_ncols=True))

    phases: dict[str, float] = {}
    lap = [time.perf_counter()]

    def tick() -> None:
        bars[-1].update(1)
        check()

    def done(phase: str) -> None:
        now = time.perf_counter()
        phases[phase] = now - lap[0]
        lap[0] = now

    try:
        traces = []
        phase("traces", len(prompts))
        with pipe.lock:  # direct use of the target and the host: no generation of another thread meanwhile
            for p, text in zip(prompts, greedy_texts(pipe, prompts, cfg.max_tokens)):
                traces.append(trace(pipe, p, cfg.max_tokens, layers, max(cfg.gammas), text=text))
                tick()
            acc = Acceptance([tr for tr, _ in traces])
            done("traces")
            bench = _Bench(pipe, traces[0][1])  # over a prompt and its greedy text
            # measure_timings' pieces: the verify widths, the windows, the rollouts, the prepares, the split forwards
            phase("timings", len({1} | {g + 1 for g in cfg.gammas}) + 2 * len(cfg.gammas)
                  + len(cfg.gammas) * len(cfg.kappas) + len(layers) * len(cfg.gammas)
                  + len(cfg.gammas) * pipe.engine.drafts_locally)  # sd's in-process windows
            t = measure_timings(pipe, bench, cfg, layers, tick, step)
        mirror_probes = [c for c in probes if c.mode == "mirror"]
        phase("suffix ‖ rollout", None)  # rounds until the top is measured: not known ahead
        measure_parallel(pipe, bench, t, mirror_probes, acc, len(mirror_probes), cfg.reps, tick, cfg.min_timed_s, step)
        done("timings")
        phase("probes", len(probes))
        probe_runs = measure_overheads(pipe, t, probes, cfg, prompts, check, step)
        bars[-1].update(len(probes))
        done("probes")
        phase("suffix ‖ rollout", None)
        n_parallel = measure_parallel(pipe, bench, t, configs, acc, top, cfg.reps, tick, cfg.min_timed_s, step)
        done("parallel")
        # The top predictions and ar, on the first few prompts: probes among them add the other prompts
        # to their runs on the first; the probes outside stay measured on one prompt and are not candidates.
        confirm = None
        if step.lead:
            ranked = rank(configs, t, acc)
            confirm = pick_confirm(ranked, cfg.confirm)
            confirm += [Config("ar")] if Config("ar") not in confirm else []
            if "split" in placements and not any(c.mode == "mirror" for c in confirm):
                # mirror's points in both placements: the best mirror prediction at least
                confirm += [next(r["config"] for r in ranked if r["config"].mode == "mirror")]
        if step.group is not None:
            confirm = step.pick(confirm, configs)
        splits = [replace(c, placement="split") for c in confirm if c.mode == "mirror"] if "split" in placements else []
        measured = {c: r for c, r in probe_runs.items()}
        own = {c: prompts[1 if c in probes else 0: cfg.confirm_prompts] for c in confirm}
        own.update({c: prompts[: cfg.confirm_prompts] for c in splits})  # the prompts its unpinned twin covers
        confirm_runs = confirm + splits
        phase("confirm", len(confirm_runs))
        measured.update(run_configs(pipe, confirm_runs, own, cfg.max_tokens, warm_up=splits, check=check,
                                    min_seconds=cfg.min_seconds, sums={c: r["sums"] for c, r in probe_runs.items()},
                                    step=step))
        bars[-1].update(len(confirm_runs))
        phase("suffix ‖ rollout", None)
        # The probes' overheads again from all their runs, the confirmation's too: on a ms-scale pair the
        # machine's speed moves 10-20 % between the probe runs and the confirmation seconds later, and a
        # fit to twice the runs follows the calibration's whole span (the table's predictions use it).
        if step.lead:
            fit_overheads(t, {c: measured[c] for c in probes})
        n_parallel += measure_parallel(pipe, bench, t, configs, acc, top, cfg.reps, tick, cfg.min_timed_s, step)
        done("confirm")
    finally:
        if bars:
            bars[-1].close()
    if not step.lead:  # a rank beside rank 0: it ran the target's side; rank 0 holds the profile
        return None
    ranked = rank(configs, t, acc)
    counts = {g: acc.window_counts(g) for g in cfg.gammas}
    table = [dict(asdict(r["config"]), predicted=r["tokens_per_second"],
                  measured=measured[r["config"]]["tokens_per_second"] if r["config"] in measured else None,
                  measured_step_ms=1e3 * measured[r["config"]]["step_s"] if r["config"] in measured else None,
                  probe=r["config"] in probes, confirmed=r["config"] in confirm, bound=r["bound"],
                  tokens_per_step=r["tokens_per_step"], reuse=r["reuse"], step_ms=1e3 * r["step_s"],
                  comm_ms=1e3 * r["comm_s"]) for r in ranked]
    for row, r in zip(table, ranked):
        place_row(row, {p: measured.get(replace(r["config"], placement=p)) for p in placements})
    best, ar, margin = choose(table)
    c = row_config(best)
    placed = f", placement {best['placement']}" if best["mode"] == "mirror" else ""
    why = (f"tuned: {expected_rate(best):.0f} tok/s expected{placed} vs ar {expected_rate(ar):.0f}"
           f" (measured {best['measured']:.0f}, predicted {best['predicted']:.0f}; best of {len(confirm)} confirmed, "
           f"{len(configs)} predicted{margin})")
    calibration = {"seconds": time.perf_counter() - started, "phases": phases, "prompts": len(prompts),
                   "max_tokens": cfg.max_tokens, "parallel_measured": n_parallel,
                   "acceptance": {str(g): list(v) for g, v in counts.items()},  # γ: [accepted, rejections]
                   "timings": {k: {str(kk): v for kk, v in d.items()} for k, d in asdict(t).items()}}
    if step.group is not None:
        calibration["ranks"] = step.group.size()
    log(f"calibrated in {calibration['seconds']:.1f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items()) + ")")
    if key is None:
        key = profiles.pipe_key(pipe)
    return profiles.Profile(key=key, mode=c.mode, kappa=c.kappa, gamma=c.gamma, exit_layer=c.exit_layer,
                            branches=c.branches, why=why, table=table, calibration=calibration)
