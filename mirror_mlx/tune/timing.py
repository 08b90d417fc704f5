"""Component timings for tune's step model (cost_model.Timings): the pieces of a step, each timed alone on
the worker that runs it in the engine, in interleaved rounds; across ranks in lockstep with rank 0."""

import statistics
import time
from functools import partial
from typing import Callable, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

from ..engine.exit_adapter import adapter_for
from ..engine.model_parts import text_model, trimmable_cache
from ..options import DRAFT_TIMEOUT_S
from ..engine.target import EarlyExitTarget, top_k
from .cost_model import Acceptance, Config, Timings, rank
from .profile import PairView

# Each piece is timed at least `reps` times and at least `min_timed_s` (MIN_TIMED_S; the quick calibration
# 0.05 s): a ms-scale piece's speed moves by 10-30 % from one tenth of a second to the next on a shared
# machine (a piece of 100 ms or more costs no extra time). The quick calibration accepts that noise to halve
# a first call on a ms-scale pair (9.7 s to 5.2 s on the demo pair here): its choice rests on the configurations
# it then runs end to end, not on the pieces alone.
MIN_TIMED_S = 0.3
MAX_REPS = 100


class Lockstep:
    """Who decides. In one process every decision is this process's own; across ranks (a pipeline with a
    `group`) rank 0's, shared with the others (one small all_sum), so every rank runs the same forwards."""

    def __init__(self, pipe: Optional[PairView]):
        self.pipe = pipe
        self.group = getattr(pipe, "group", None)
        self.lead = self.group is None or self.group.rank() == 0

    def ints(self, values: Sequence[int], size: int) -> list[int]:
        """Rank 0's `values` (at most `size`, padded with 0) on every rank."""
        if self.group is None:
            return list(values) + [0] * (size - len(values))
        agree: Callable[[Sequence[int], int, str], list[int]] = getattr(self.pipe, "agree")  # (distributed's)
        return agree(values, size, "rank 0's calibration")

    def flags(self, flags: Sequence[bool]) -> list[bool]:
        return [bool(f) for f in self.ints([int(f) for f in flags], len(flags))]

    def pick(self, chosen: Optional[Sequence[Config]], among: Sequence[Config]) -> list[Config]:
        """Rank 0's `chosen` (configurations of `among`, the same list on every rank) on every rank."""
        assert chosen is not None or not self.lead, "rank 0 chooses"
        mine = [len(chosen), *(among.index(c) for c in chosen)] if self.lead and chosen is not None else []
        got = self.ints(mine, len(among) + 1)
        return [among[i] for i in got[1 : 1 + got[0]]]


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


class Bench:
    """Timed pieces over one committed context, each on the worker that runs it in the engine; each
    method times one call and returns its seconds (`interleaved` repeats them)."""

    def __init__(self, pipe: PairView, context: list[int]):
        self.engine, self.model, self.context = pipe.engine, pipe.model, context
        self.draft = self.engine.draft_host  # None on a rank beside rank 0: the target's pieces only
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

    def comm(self, n: int, group: mx.distributed.Group) -> float:
        """T_comm over `n` rows across ranks: one sharded forward's two all_sums of n × hidden per layer, chained
        in one graph as the forward chains them (an eval after each would time MLX's per-eval overhead too).
        Every rank must call it."""
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

    def rollout(self, stems: list[list[int]], gamma: int, prepared: Optional[bool] = None) -> float:
        """A blocking host rollout after two newly committed tokens (sent with the request, as in a real step):
        the round trip the scheduler waits for. Branches (or `prepared`) follow a prepare, as in a mirror step."""
        self._ready(gamma, len(stems) > 1 if prepared is None else prepared)
        ctx = self.context[:-1]
        t0 = time.perf_counter()
        self.draft.rollout(ctx, stems, gamma, timeout=DRAFT_TIMEOUT_S)
        return time.perf_counter() - t0

    def _ready(self, gamma: int, prepared: bool) -> None:
        """The host's draft cache as a real step has it before its rollout: two committed tokens behind, or
        (prepared) holding the committed tokens and the γ-token window `stems` branch from (mirror's prepare)."""
        ctx = self.context[:-1]
        self.draft.post_sync(ctx + self.context[-gamma:] if prepared else ctx[:-2])
        self.draft.wait_done(DRAFT_TIMEOUT_S)

    def prepare(self, gamma: int) -> float:
        """Mirror's prepare after two newly committed tokens: the draft feeds them and the γ-token window
        (beside the target's prefix in a real step)."""
        self._ready(gamma, False)
        t0 = time.perf_counter()
        self._ready(gamma, True)
        return time.perf_counter() - t0

    def local_rollout(self, gamma: int) -> float:
        """sd's window where it drafts in-process, on the target's thread (no ring), as in a real sd step."""
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


def split_comm(t: Timings, comm: dict, n_layers: int) -> None:
    """T_comm by row count (`Bench.comm`) into the step model: each target piece was timed with its collectives
    in it, so its compute alone is kept (minus its share: ℓ_e of the N layers' for a prefix, the rest for a
    suffix) and cost_model adds T_comm back once per forward, a term of its own (what another link would
    change). Under load a piece's compute can come out below 0: the sum is still the measured piece."""
    t.comm = dict(comm)
    t.comm_prefix = {(e, n): comm[n] * e / n_layers for e, n in t.prefix}
    t.verify = {n: v - comm[n] for n, v in t.verify.items()}
    t.prefix = {(e, n): v - t.comm_prefix[(e, n)] for (e, n), v in t.prefix.items()}
    t.suffix = {(e, n): v - (comm[n] - t.comm_prefix[(e, n)]) for (e, n), v in t.suffix.items()}


def measure_parallel(pipe: PairView, b: Bench, t: Timings, configs: list[Config], acc: Acceptance, top: int,
                     reps: int, tick: Callable, min_s: float = MIN_TIMED_S, step: Optional[Lockstep] = None) -> int:
    """Measure suffix ‖ rollout at the mirror points that can reach the `top` best predictions; returns how many.

    Unmeasured points are predicted at their floor (cost_model.parallel_time), an upper bound, so measuring the
    unmeasured among the top until it is all measured gives the top that measuring every point would, at a
    fraction of the time. A round after the first times the first point measured beside its new ones and puts
    them on its scale: a ms-scale pair's speed moves 10-30 % between rounds seconds apart. Across ranks rank 0
    ranks and says which points to measure (the others hold no draft timings)."""
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
