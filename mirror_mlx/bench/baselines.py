"""The baselines Mirror-SD is measured against: mlx-lm's own generation loops, timed one way.

`run_ar` drives mlx-lm's `generate_step`, `run_mlx_sd` its `speculative_generate_step`, unchanged.
Both runs start from fresh caches (a plain `KVCache` per layer, so mlx-lm's speculative rewind is
always possible) into which we prefill all prompt tokens but the last, timed apart; the decode clock
then runs from handing mlx-lm the last prompt token to holding the last generated token, as
mlx-lm's own `generation_tps` does. Target forwards are counted by wrapping the model's `__call__`.
"""

import time
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Iterable, Iterator, Optional, Sequence, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import make_sampler

from ..validate import generator_seed


@dataclass
class Run:
    """One generation: its tokens and what it cost."""

    mode: str  # "ar" or "mlx_sd"
    tokens: list[int]
    prefill_s: float  # all prompt tokens but the last, into the target's (and draft's) fresh cache
    decode_s: float  # the last prompt token to the last generated token
    tokens_per_s: float  # generated tokens / decode_s (prefill excluded)
    target_forwards: int  # target calls while decoding (ar includes mlx-lm's one look-ahead forward)
    accepted_per_forward: Optional[float]  # mlx_sd: tokens per target forward, correction included
    peak_memory: int  # bytes, mx.get_peak_memory over the run
    num_draft_tokens: Optional[int] = None


class _Counted:
    """A model whose calls are counted; everything else passes through."""

    def __init__(self, model: nn.Module):
        self.model, self.calls = model, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def fresh_cache(model: nn.Module) -> list[KVCache]:
    return [KVCache() for _ in model.layers]


def prefill(model: nn.Module, cache: list[KVCache], tokens: Sequence[int], step: int = 2048) -> None:
    """Run `tokens` through `model` into `cache`, as mlx-lm's own prefill does."""
    for i in range(0, len(tokens), step):
        model(mx.array(list(tokens[i : i + step]))[None], cache=cache)
        mx.eval([c.state for c in cache])


def _decode(steps: Iterator, max_tokens: int, stop_tokens: Iterable[int]) -> tuple[list[int], float]:
    stop, tokens = set(stop_tokens), []
    t0 = time.perf_counter()
    for step in steps:
        if step[0] in stop:
            break
        tokens.append(step[0])
        if len(tokens) == max_tokens:
            break
    dt = time.perf_counter() - t0
    mx.synchronize()  # mlx-lm's look-ahead may still run: keep it out of the next measurement
    return tokens, dt


def _start(seed: int) -> None:
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    mapped = generator_seed(seed)  # any int (bench --seed -1): mapped into uint64
    assert mapped is not None
    mx.random.seed(mapped)


def run_ar(model: nn.Module, prompt: Sequence[int], max_tokens: int, temp: float = 0.0, top_p: float = 0.0,
           top_k: int = 0, seed: int = 0, stop_tokens: Iterable[int] = ()) -> Run:
    """mlx-lm's `generate_step` on `prompt` (token ids): greedy at temp 0, else sampled."""
    _start(seed)
    cache, target = fresh_cache(model), _Counted(model)
    t0 = time.perf_counter()
    prefill(model, cache, prompt[:-1])
    prefill_s = time.perf_counter() - t0
    steps = generate_step(mx.array(list(prompt[-1:])), cast(nn.Module, target), max_tokens=max_tokens,
                          prompt_cache=cache, sampler=make_sampler(temp, top_p=top_p, top_k=top_k))
    tokens, dt = _decode(steps, max_tokens, stop_tokens)
    return Run("ar", tokens, prefill_s, dt, len(tokens) / dt, target.calls, None, mx.get_peak_memory())


def run_mlx_sd(model: nn.Module, draft: nn.Module, prompt: Sequence[int], max_tokens: int,
               num_draft_tokens: int, temp: float = 0.0, top_p: float = 0.0, top_k: int = 0, seed: int = 0,
               stop_tokens: Iterable[int] = ()) -> Run:
    """mlx-lm's `speculative_generate_step` with `num_draft_tokens` drafted per target forward."""
    _start(seed)
    cache, draft_cache, target = fresh_cache(model), fresh_cache(draft), _Counted(model)
    t0 = time.perf_counter()
    prefill(draft, draft_cache, prompt[:-1])
    prefill(model, cache, prompt[:-1])
    prefill_s = time.perf_counter() - t0
    steps = speculative_generate_step(
        mx.array(list(prompt[-1:])), cast(nn.Module, target), draft, num_draft_tokens=num_draft_tokens,
        max_tokens=max_tokens, prompt_cache=cache + draft_cache, sampler=make_sampler(temp, top_p=top_p, top_k=top_k))
    tokens, dt = _decode(steps, max_tokens, stop_tokens)
    return Run("mlx_sd", tokens, prefill_s, dt, len(tokens) / dt, target.calls,
               len(tokens) / max(target.calls, 1), mx.get_peak_memory(), num_draft_tokens)


@dataclass
class SdSweep:
    """mlx_sd's speed per num_draft_tokens (median tokens/s over the prompts) and the best k."""

    best_k: int
    tokens_per_s: dict[int, float]
    runs: dict[int, list[Run]] = field(repr=False)


def best_mlx_sd(model: nn.Module, draft: nn.Module, prompts: Sequence[Sequence[int]], max_tokens: int,
                ks: Sequence[int] = (2, 3, 4, 5, 6), temp: float = 0.0, seed: int = 0, warmup: bool = True,
                stop_tokens: Iterable[int] = ()) -> SdSweep:
    """Sweep num_draft_tokens over `ks` (interleaved per prompt) and keep the fastest by median tokens/s.

    mlx-lm leaves k to the user; the fair baseline is the best k on this machine and these prompts.
    """
    if warmup:
        run_mlx_sd(model, draft, prompts[0], min(8, max_tokens), ks[0], temp, seed=seed)
    runs: dict[int, list[Run]] = {k: [] for k in ks}
    for prompt in prompts:
        for k in ks:
            runs[k].append(run_mlx_sd(model, draft, prompt, max_tokens, k, temp, seed=seed,
                                      stop_tokens=stop_tokens))
    tps = {k: median(r.tokens_per_s for r in rs) for k, rs in runs.items()}
    return SdSweep(max(tps, key=lambda k: tps[k]), tps, runs)
