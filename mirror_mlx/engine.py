"""The Mirror-SD generation loop (DESIGN §3-4), one code path for `mirror`, `sd` and `ar`.

State between steps: `committed` holds every committed token; the target's cache holds all of
them but the last (the *pending* token); `window` holds the γ draft tokens proposed after it.

mirror step:  target prefix over [pending, ŷ1..ŷγ] → early-exit top-κ sets on the ring
              → (target suffix ‖ draft rolls out every branch) → verify → reuse or fallback.
sd step:      draft rolls out one window, then the target verifies it (serial).
ar step:      the target alone, one token per forward.
Every committed token is the target's own choice (argmax, or a sample of its processed
distribution) given the committed prefix, so every mode returns what the target alone would.
"""

import asyncio
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import trim_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from .draft import common_prefix
from .draft_api import Draft
from .ring import EARLY_EXIT, WINDOW, TokenRing
from .target import EarlyExitTarget, check_exit_layer, text_model, top_k, trimmable_cache
from .workers import Worker

MODES = ("mirror", "sd", "ar")


@dataclass
class DecodeOptions:
    """How to decode: the mode, Mirror-SD's knobs and the target's sampling settings (mlx-lm's)."""

    mode: str = "auto"  # Pipeline.options resolves "auto" (mirror_mlx.tune) before the engine sees it
    max_tokens: int = 256
    kappa: int = 8
    gamma: int = 7
    exit_layer: Optional[int] = None  # None: N // 2
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop_tokens: Sequence[int] = ()
    draft_timeout: float = 60.0  # seconds; a draft slower than this is dropped (visible switch to ar)
    why: str = ""  # how the mode and knobs were chosen (shown in Stats)


@dataclass
class Stats:
    """What one generation did; `as_dict()` is what `--json` prints."""

    mode: str = "ar"  # what ran (ar after a dropped draft)
    chosen_mode: str = ""  # what was chosen, and with which knobs and why
    kappa: Optional[int] = None
    gamma: Optional[int] = None
    exit_layer: Optional[int] = None
    why: str = ""
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually run through the target (the rest came from its cache)
    generation_tokens: int = 0
    target_forwards: int = 0  # decode forwards of the target (one per step)
    draft_forwards: int = 0  # every draft forward the rollouts ran, syncing included (J per rollout)
    draft_tokens: int = 0  # per-branch tokens those forwards emitted (η̄ = draft_tokens / draft_forwards)
    rollouts: int = 0
    steps: int = 0
    reuses: int = 0
    fallbacks: int = 0
    omega_sum: float = 0.0  # target mass inside the posted C_A at each correction row
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefix_seconds: float = 0.0
    suffix_seconds: float = 0.0  # target suffix (mirror) or whole verify forward (sd, ar)
    draft_seconds: float = 0.0  # all draft rollout time: branch rollouts, fallbacks, first window
    hidden_draft_seconds: float = 0.0  # draft time that overlapped the target's suffix
    draft_failure: Optional[str] = None
    peak_memory_gb: float = 0.0
    timeline: list = field(default_factory=list, repr=False)  # per step (prefix, suffix, rollout) intervals

    @property
    def mean_accepted(self) -> float:
        return self.generation_tokens / max(self.target_forwards, 1)

    @property
    def fallback_rate(self) -> float:
        return self.fallbacks / max(self.steps, 1)

    @property
    def reuse_rate(self) -> float:
        return self.reuses / max(self.steps, 1)

    @property
    def omega_kappa(self) -> float:
        return self.omega_sum / max(self.steps, 1)

    @property
    def hidden_draft_fraction(self) -> float:
        return self.hidden_draft_seconds / self.draft_seconds if self.draft_seconds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generation_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def eta(self) -> float:
        return self.draft_tokens / max(self.draft_forwards, 1)

    @property
    def draft_forwards_per_window(self) -> float:
        return self.draft_forwards / max(self.rollouts, 1)

    def as_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "timeline"}
        for name in ("mean_accepted", "fallback_rate", "reuse_rate", "omega_kappa", "hidden_draft_fraction",
                     "tokens_per_second", "eta", "draft_forwards_per_window"):
            d[name] = getattr(self, name)
        return d

    def summary(self) -> str:
        line = (f"{self.tokens_per_second:.1f} tok/s | {self.mean_accepted:.2f} accepted/forward"
                f" | mode {self.mode}")
        if self.mode == "mirror":
            line += f" κ={self.kappa} γ={self.gamma} ℓe={self.exit_layer}"
        elif self.mode == "sd":
            line += f" γ={self.gamma}"
        if self.why.startswith(("auto", "quick")):
            line += f" ({self.why})"
        if self.mode == "mirror":
            line += (f" | fallback {100 * self.fallback_rate:.0f}% | reuse {100 * self.reuse_rate:.0f}%"
                     f" | hidden draft {100 * self.hidden_draft_fraction:.0f}%")
        if self.draft_failure:
            line += f" | draft dropped: {self.draft_failure}"
        return line


def accept(window: Sequence[int], ys: Sequence[int]) -> int:
    """A: the longest prefix of the window that equals the target's own tokens."""
    a = 0
    while a < len(window) and window[a] == ys[a]:
        a += 1
    return a


def reuse_window(cand: list[list[int]], windows: list[list[list[int]]], a: int, c: int) -> Optional[list[int]]:
    """The precomputed window w(A, c) if the correction c was among row A's candidates, else None."""
    if c in cand[a]:
        return windows[a][cand[a].index(c)]
    return None


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


class TargetSide:
    """The target's state; every method runs on the target worker thread."""

    def __init__(self, model: nn.Module, adapter: Optional[Callable] = None):
        self.model = model
        self.adapter = adapter
        self.tapped: Optional[EarlyExitTarget] = None
        self.cache: list[Any] = trimmable_cache(model)
        self.cached: list[int] = []  # tokens whose keys/values the cache holds
        self._final: Optional[mx.array] = None
        self._ids: Optional[mx.array] = None

    def set_exit_layer(self, exit_layer: int) -> None:
        if self.tapped is None or self.tapped.exit_layer != exit_layer:
            if self.tapped is not None:
                self.tapped.remove()
            self.tapped = EarlyExitTarget(self.model, exit_layer, self.adapter)

    def start(self, prompt: Sequence[int], step_size: int = 2048) -> int:
        """Make the cache hold prompt[:-1]; reuse the longest cached prefix. Returns tokens run."""
        head = list(prompt[:-1])
        keep = common_prefix(self.cached, head)
        if keep < len(self.cached):
            trim_prompt_cache(self.cache, len(self.cached) - keep)
        new = head[keep:]
        for i in range(0, len(new), step_size):
            self.model(mx.array([new[i : i + step_size]]), cache=self.cache)
            mx.eval([c.state for c in self.cache])
        self.cached = head
        return len(new)

    def prefix(self, rows: list[int], kappa: int, exclude: list[int], ring: TokenRing, step: int) -> int:
        """Blocks 1..ℓ_e over the rows; posts the early-exit top-κ sets on the ring (returns its seq)."""
        early, self._final = self.tapped.forward(mx.array([rows]), self.cache)
        ids, logprobs = top_k(early[0], kappa, exclude)
        mx.eval(ids, logprobs)
        self._ids = ids
        return ring.put(EARLY_EXIT, step, ids.tolist(), logprobs.tolist())

    def suffix(self, history: list[int], window: list[int], sampler, processors) -> tuple[list[int], int, float]:
        """Blocks ℓ_e+1..N, then verify. Returns (target tokens, A, target mass inside C_A)."""
        ys, a, logits = self._verify(self._final, history, window, sampler, processors)
        probs = mx.softmax(logits[a].astype(mx.float32), axis=-1)
        omega = mx.take(probs, self._ids[a]).sum().item()
        self._final = self._ids = None
        return ys, a, omega

    def verify(self, history: list[int], window: list[int], sampler, processors) -> tuple[list[int], int]:
        """One plain forward over [pending, window], then verify (sd and ar)."""
        logits = self.model(mx.array([[history[-1]] + window]), cache=self.cache)
        ys, a, _ = self._verify(logits, history, window, sampler, processors)
        return ys, a

    def _verify(self, logits, history, window, sampler, processors):
        logits = logits[0]
        ys = sample_rows(logits, history, window, sampler, processors)
        a = accept(window, ys)
        trim_prompt_cache(self.cache, len(window) - a)
        self.cached = list(history) + window[:a]
        return ys, a, logits

    def close(self) -> None:
        if self.tapped is not None:
            self.tapped.remove()
            self.tapped = None


def sample_rows(logits: mx.array, history: list[int], window: list[int], sampler, processors) -> list[int]:
    """The target's token at every row, exactly as mlx-lm's generate_step would choose it.

    Row j follows history + window[:j]; logits processors see that row's own history.
    """
    if processors:
        rows = []
        for j in range(logits.shape[0]):
            row = logits[j : j + 1]
            tokens = mx.array(list(history) + list(window[:j]))
            for p in processors:
                row = p(tokens, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sampler(logprobs).tolist()


class Engine:
    """Owns the target worker, the draft worker and the token rings; `generate` yields tokens."""

    def __init__(self, target_model: nn.Module, draft: Optional[Draft] = None,
                 exit_adapter: Optional[Callable] = None):
        self.target_model = target_model
        self.n_layers = len(text_model(target_model).layers)
        self.context_length = getattr(getattr(text_model(target_model), "args", None), "max_position_embeddings", None)
        self.draft = draft
        self.exit_adapter = exit_adapter
        self.target_worker = Worker("target")
        self.draft_worker = Worker("draft") if draft is not None else None
        self.target = self.target_worker.call(TargetSide, target_model, exit_adapter)
        self.draft_failure: Optional[str] = None
        self.stats = Stats()

    def close(self) -> None:
        self.target_worker.call(self.target.close)
        self.target_worker.close()
        if self.draft_worker:
            self.draft_worker.close()

    def reset(self) -> None:
        """Forget cached conversation state (both caches)."""
        self.target_worker.call(self._reset_target)
        if self.draft is not None and self.draft_failure is None:
            self.draft_worker.call(self.draft.reset)

    def _reset_target(self) -> None:
        self.target.cache = trimmable_cache(self.target_model)
        self.target.cached = []

    def check(self, prompt: Sequence[int], opts: DecodeOptions) -> None:
        """Refuse bad options with one sentence naming the problem and the fix."""
        if opts.mode not in MODES:
            raise ValueError(f"unknown mode {opts.mode!r}: choose one of {', '.join(MODES)}")
        if opts.mode != "ar" and self.draft is None:
            raise ValueError(f"mode {opts.mode!r} needs a draft model: pass draft_model=..., or use mode='ar'")
        if opts.kappa < 1:
            raise ValueError(f"kappa must be at least 1 (got {opts.kappa})")
        if opts.gamma < 1:
            raise ValueError(f"gamma must be at least 1 (got {opts.gamma})")
        if opts.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 (got {opts.max_tokens})")
        check_exit_layer(self.exit_layer(opts), self.n_layers)
        if self.exit_adapter is not None and opts.mode == "mirror":
            from .exit_adapter import check_layer

            check_layer(self.exit_adapter, self.exit_layer(opts))
        if len(prompt) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if self.context_length and len(prompt) + opts.max_tokens > self.context_length:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({opts.max_tokens}) exceeds the target's "
                f"context of {self.context_length} tokens: shorten the prompt or lower max_tokens"
            )

    def exit_layer(self, opts: DecodeOptions) -> int:
        """ℓ_e: as asked, else the exit adapter's layer, else N // 2 (the paper's default)."""
        if opts.exit_layer is not None:
            return opts.exit_layer
        return getattr(self.exit_adapter, "exit_layer", None) or max(1, self.n_layers // 2)

    def generate(self, prompt: Sequence[int], opts: DecodeOptions) -> Iterator[list[int]]:
        """Yield committed tokens, a chunk per step, until max_tokens or a stop token."""
        prompt = [int(t) for t in prompt]
        self.check(prompt, opts)
        mode = opts.mode if self.draft_failure is None else "ar"
        stats = self.stats = Stats(mode=mode, prompt_tokens=len(prompt), draft_failure=self.draft_failure)
        stats.chosen_mode, stats.kappa, stats.gamma, stats.why = opts.mode, opts.kappa, opts.gamma, opts.why
        stats.exit_layer = self.exit_layer(opts) if opts.mode == "mirror" else None
        sampler = make_sampler(opts.temperature, top_p=opts.top_p if opts.top_p < 1.0 else 0.0,
                               min_p=opts.min_p, top_k=opts.top_k)
        processors = make_logits_processors(repetition_penalty=opts.repetition_penalty)
        if opts.seed is not None:
            mx.random.seed(opts.seed)
        mx.reset_peak_memory()
        if mode == "mirror":
            self.target_worker.call(self.target.set_exit_layer, self.exit_layer(opts))
        t0 = time.perf_counter()
        sync = getattr(self.draft, "sync", None) if mode != "ar" else None
        draft_prefill = self.draft_worker.submit(sync, prompt[:-1]) if sync else None  # beside the target's
        stats.prefill_tokens = self.target_worker.call(self.target.start, prompt)
        if draft_prefill is not None:
            try:
                draft_prefill.result(timeout=opts.draft_timeout)
            except Exception as e:  # the draft cannot even prefill: the target alone, visibly
                self._drop_draft(e, stats)
                mode = stats.mode = "ar"
        stats.prefill_seconds = time.perf_counter() - t0
        committed, produced = list(prompt), 0
        loop = asyncio.new_event_loop()
        ring_te = ring_dt = None
        t_decode = time.perf_counter()
        try:
            window = None
            if mode == "mirror":
                n = opts.gamma
                ring_te = TokenRing(capacity=4, max_ints=(n + 1) * opts.kappa, max_floats=(n + 1) * opts.kappa)
                ring_dt = TokenRing(capacity=4, max_ints=(n + 1) * opts.kappa * n, max_floats=1)
                window = self._fresh_window(loop, committed, opts, stats)
                if window is None:
                    mode = stats.mode = "ar"
            while produced < opts.max_tokens:
                if mode == "mirror" and self.draft_failure is None:
                    new, window = loop.run_until_complete(
                        self._mirror_step(committed, window, opts, sampler, processors, stats, ring_te, ring_dt))
                elif mode == "sd" and self.draft_failure is None:
                    new = loop.run_until_complete(self._sd_step(committed, opts, sampler, processors, stats))
                else:
                    s0 = time.perf_counter()
                    ys, _ = self.target_worker.call(self.target.verify, committed, [], sampler, processors)
                    stats.suffix_seconds += time.perf_counter() - s0
                    new = ys[:1]
                stats.target_forwards += 1
                stats.steps += 1
                new = new[: opts.max_tokens - produced]
                stop = next((i for i, t in enumerate(new) if t in opts.stop_tokens), None)
                if stop is not None:
                    new = new[: stop + 1]
                committed += new
                produced += len(new)
                stats.generation_tokens = produced
                stats.decode_seconds = time.perf_counter() - t_decode
                yield new
                if stop is not None:
                    break
        finally:
            loop.close()
            for ring in (ring_te, ring_dt):
                if ring is not None:
                    ring.close()
            stats.decode_seconds = time.perf_counter() - t_decode
            stats.peak_memory_gb = mx.get_peak_memory() / 1e9

    # --- steps -------------------------------------------------------------------------------------

    async def _mirror_step(self, committed, window, opts, sampler, processors, stats, ring_te, ring_dt):
        kappa, gamma = opts.kappa, len(window)
        rows = [committed[-1]] + window
        exclude = window + [-1]  # row r < γ never proposes ŷ_{r+1}; the bonus row keeps plain top-κ
        seq, p0, p1 = await self.target_worker.run(self.target.prefix, rows, kappa, exclude, ring_te, stats.steps)
        suffix = asyncio.ensure_future(self.target_worker.run(self.target.suffix, committed, window, sampler, processors))
        rollout = asyncio.ensure_future(self.draft_worker.run(
            self._branch_rollout, ring_te, ring_dt, seq, list(committed), window, kappa, gamma))
        (ys, a, omega), s0, s1 = await suffix
        new = window[:a] + [ys[a]]
        try:
            (cand, windows, forwards, tokens), r0, r1 = await asyncio.wait_for(rollout, self._time_left(opts, s1))
        except Exception as e:  # the draft raised or stalled: finish with the target alone, visibly
            self._drop_draft(e, stats)
            return new, None
        stats.prefix_seconds += p1 - p0
        stats.suffix_seconds += s1 - s0
        stats.draft_seconds += r1 - r0
        stats.hidden_draft_seconds += overlap(r0, r1, s0, s1)
        stats.draft_forwards += forwards
        stats.draft_tokens += tokens
        stats.rollouts += 1
        stats.omega_sum += omega
        stats.timeline.append({"prefix": (p0, p1), "suffix": (s0, s1), "rollout": (r0, r1), "accepted": a})
        reused = reuse_window(cand, windows, a, new[-1])
        if reused is not None:
            stats.reuses += 1
            return new, reused
        stats.fallbacks += 1
        return new, await self._timed_rollout(committed + new, opts, stats)  # the target waits

    def _time_left(self, opts: DecodeOptions, since: float) -> float:
        return max(0.0, opts.draft_timeout - (time.perf_counter() - since))

    def _branch_rollout(self, ring_te, ring_dt, seq, context, window, kappa, gamma):
        """Draft thread: read the early-exit sets from the ring, roll out all κ·(γ+1) branches."""
        msg = ring_te.get(seq)
        if msg is None:
            raise RuntimeError(f"early-exit message {seq} was not on the ring")
        cand = msg.ints.reshape(gamma + 1, -1).tolist()
        stems = [window[:r] + [v] for r in range(gamma + 1) for v in cand[r]]
        out = self.draft.rollout(context, stems, gamma)
        flat = [t for w in out.windows for t in w]
        back = ring_dt.get(ring_dt.put(WINDOW, msg.step, flat))
        it = iter(back.ints.reshape(len(stems), gamma).tolist())
        windows = [[next(it) for _ in cand[r]] for r in range(gamma + 1)]
        return cand, windows, out.forwards, out.tokens

    async def _sd_step(self, committed, opts, sampler, processors, stats):
        window = await self._timed_rollout(committed, opts, stats)
        if window is None:
            ys, _ = self.target_worker.call(self.target.verify, committed, [], sampler, processors)
            return ys[:1]
        (ys, a), s0, s1 = await self.target_worker.run(self.target.verify, committed, window, sampler, processors)
        stats.suffix_seconds += s1 - s0
        return window[:a] + [ys[a]]

    async def _timed_rollout(self, committed, opts, stats) -> Optional[list[int]]:
        """One fresh window after `committed`, on the critical path; None if the draft failed."""
        job = self.draft_worker.run(self.draft.rollout, committed[:-1], [[committed[-1]]], opts.gamma)
        try:
            out, r0, r1 = await asyncio.wait_for(job, opts.draft_timeout)
        except Exception as e:
            self._drop_draft(e, stats)
            return None
        stats.draft_seconds += r1 - r0
        stats.draft_forwards += out.forwards
        stats.draft_tokens += out.tokens
        stats.rollouts += 1
        return out.windows[0]

    def _fresh_window(self, loop, committed, opts, stats):
        return loop.run_until_complete(self._timed_rollout(committed, opts, stats))

    def _drop_draft(self, error: BaseException, stats: Stats) -> None:
        reason = "timed out" if isinstance(error, (asyncio.TimeoutError, TimeoutError)) else repr(error)
        self.draft_failure = stats.draft_failure = f"draft {reason}; continuing with the target alone (ar)"
        print(f"mirror-mlx: warning: {self.draft_failure}", file=sys.stderr)
