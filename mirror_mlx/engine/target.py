"""The target side: an early-exit tap (one forward gives the logits at layer ℓ_e and at layer N), top-κ,
and `TargetSide`, the target's cache and the forwards of a step, run on the target's thread.

No per-architecture code: block ℓ_e's class is swapped for a subclass that records its output, and the early
head calls the outer model with an inner model whose `__call__` returns the normalised recorded state, so
tied or untied heads, logit soft-caps and logit scaling come along for free.
"""

import copy
import time
from types import SimpleNamespace
from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import trim_prompt_cache

from . import recurrent
from .recurrent import LayerCache
from .branch_budget import ExitView
from .readback import float_rows, floats, int_rows, integer, scalar
from .model_parts import common_prefix, family, inner_model, text_model, trimmable_cache, vocab_size
from ..options import default_exit_layer
from .sampling import sample_rows
from . import tree as trees


FINAL_NORMS = ("norm", "norm_f", "final_layernorm", "embedding_norm")  # the inner model's last module, by family


def final_norm(model: nn.Module) -> nn.Module:
    inner = inner_model(model)
    name = next((n for n in FINAL_NORMS if n in inner), None)
    if name is None:
        raise ValueError(f"this {family(model)} model's final norm is none of {', '.join(FINAL_NORMS)}: its "
                         "early exit cannot reuse it; use mode sd or ar")
    return inner[name]


def _install_tap(block: nn.Module, tap: SimpleNamespace) -> type:
    """Swap `block`'s class for one that keeps its output of the forward in flight in `tap.h`; the old class."""
    cls = type(block)

    def __call__(self, *args, **kwargs):
        tap.h = cls.__call__(self, *args, **kwargs)
        return tap.h

    block.__class__ = type("Tapped" + cls.__name__, (cls,), {"__call__": __call__})
    return cls


def check_exit_layer(exit_layer: int, n_layers: int) -> None:
    if not 1 <= exit_layer <= n_layers - 1:
        raise ValueError(f"exit layer {exit_layer} is outside 1..{n_layers - 1} for a target with {n_layers} layers "
                         f"(choose a layer in that range, e.g. {default_exit_layer(n_layers)})")


class EarlyExitTarget:
    """An mlx-lm model tapped at block `exit_layer` (1-based count of blocks before the exit); a stage of a
    model split by layers across ranks holds blocks first..first+len-1 of `n_layers`, the tapped one among them."""

    def __init__(self, model: nn.Module, exit_layer: int, adapter: Optional[Callable] = None,
                 n_layers: Optional[int] = None, first: int = 0):
        self.model = model
        self.layers = text_model(model).layers
        self.n_layers = n_layers or len(self.layers)
        check_exit_layer(exit_layer, self.n_layers)
        if not first < exit_layer <= first + len(self.layers):
            raise ValueError(f"block {exit_layer} is not on this stage "
                             f"(blocks {first + 1}..{first + len(self.layers)})")
        self.exit_layer = exit_layer
        self.adapter = adapter  # maps the normalised exit state before the head; never the final logits
        self._tap = SimpleNamespace(h=None)
        self._block = self.layers[exit_layer - 1 - first]
        self._block_cls = _install_tap(self._block, self._tap)

    def remove(self) -> None:
        """Undo the class swap (the model is then exactly as loaded)."""
        self._block.__class__ = self._block_cls

    def forward(self, tokens: mx.array, cache: Optional[list[LayerCache]]) -> tuple[mx.array, mx.array]:
        """Lazy (early_logits, final_logits) of one forward over `tokens` (B, T): evaluating the early ones first
        runs only blocks 1..ℓ_e and the head; the final ones then reuse block ℓ_e's output."""
        final = self.model(tokens, cache=cache)
        early = self.head(self._tap.h)
        self._tap.h = None
        return early, final

    def head(self, h: mx.array) -> mx.array:
        """The model's own final norm (+ adapter) and head applied to a hidden state."""
        x = final_norm(self.model)(h)
        return apply_head(self.model, self.adapter(x) if self.adapter is not None else x)


def apply_head(model: nn.Module, x: mx.array) -> mx.array:
    """The model's own head (tied or not, soft-caps, logit scaling) on an already normalised state (B, T, D):
    the outer model runs as usual over an inner model whose `__call__` returns `x`."""
    tm = text_model(model)
    inner = inner_model(model)
    cls = type(inner)
    inner.__class__ = type("Given" + cls.__name__, (cls,), {"__call__": lambda self_, *a, **k: x})
    try:
        return tm(mx.zeros(x.shape[:2], dtype=mx.int32))
    finally:
        inner.__class__ = cls


def top_k(logits: mx.array, k: int, exclude: Optional[list[int]] = None) -> tuple[mx.array, mx.array]:
    """Top-k ids and log-probs of each row of `logits` (T, V), most likely first. `exclude[r]` (or -1): a token
    row r must not propose (a correction is never the draft token it rejected: docs/design.md §3 step 2)."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    scores = logprobs
    if exclude is not None:
        ex = mx.array(exclude, dtype=mx.int32)[:, None]
        hit = mx.arange(logits.shape[-1])[None, :] == ex
        scores = mx.where(hit, -mx.inf, logprobs)
    k = min(k, logits.shape[-1])
    ids = mx.argpartition(-scores, kth=k - 1, axis=-1)[:, :k]
    order = mx.argsort(-mx.take_along_axis(scores, ids, axis=-1), axis=-1)
    ids = mx.take_along_axis(ids, order, axis=-1)
    return ids, mx.take_along_axis(logprobs, ids, axis=-1)


def top_ids(logits: mx.array, k: int) -> mx.array:
    """Each row's k most likely next ids (T, k), most likely first."""
    ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]
    return mx.take_along_axis(ids, mx.argsort(-mx.take_along_axis(logits, ids, axis=-1), axis=-1), axis=-1)


def drafted_logprobs(logits: mx.array, rows: Sequence[int]) -> mx.array:
    """The early exit's log-prob of each drafted token at the row before it (rows = [pending, ŷ1..ŷγ]):
    γ values, what the branch budget (branch_budget.py) reads P(reaching a row) from."""
    if len(rows) < 2:
        return mx.zeros((0,), dtype=mx.float32)
    logits = logits[:-1].astype(mx.float32)
    picked = mx.take_along_axis(logits, mx.array(list(rows[1:]), dtype=mx.int32)[:, None], axis=-1)[:, 0]
    return picked - mx.logsumexp(logits, axis=-1)


def accept(window: Sequence[int], ys: Sequence[int]) -> int:
    """A: the longest prefix of the window that equals the target's own tokens."""
    return common_prefix(window, ys)


class TargetSide:
    """The target's state; every method runs on the target worker thread."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.tapped: Optional[EarlyExitTarget] = None
        self.cache: list[LayerCache] = trimmable_cache(model)
        self.cached: list[int] = []  # tokens whose keys/values the cache holds (after `base` rows)
        self.base = 0  # rows before `cached`: a given prompt cache's prefix of unknown tokens
        self.adopted = False  # the cache is the caller's (a prompt cache), until `release`
        self._final: Optional[mx.array] = None
        self._ids: Optional[mx.array] = None
        self.logprobs: Optional[mx.array] = None  # the last verify's rows (sample_rows), for Step.logprobs
        self.seen: Optional[tuple[list[int], np.ndarray]] = None  # the last `hold(top=k)`'s tokens and their top ids

    def set_exit_layer(self, exit_layer: int, head: Optional[Callable] = None) -> None:
        """Tap block ℓ_e, with `head` (the exit adapter's, for that layer) before the model's own head."""
        if self.tapped is None or self.tapped.exit_layer != exit_layer or self.tapped.adapter is not head:
            if self.tapped is not None:
                self.tapped.remove()
            self.tapped = EarlyExitTarget(self.model, exit_layer, head)

    @property
    def tap(self) -> "EarlyExitTarget":
        """The tap at ℓ_e: mode mirror sets it (set_exit_layer) before its first prefix."""
        assert self.tapped is not None, "set_exit_layer first"
        return self.tapped

    def adopt(self, cache: list[LayerCache], tokens: Optional[list[int]]) -> None:
        """Continue the caller's prompt cache (extended in place, until `release`): it holds `tokens`, or
        (None) a prefix of unknown tokens that the prompt follows (mlx-lm's; mode ar only)."""
        self.cache, self.cached, self.adopted = recurrent.convert(
            cache, offset=recurrent.held(cache, len(tokens or []))), list(tokens or []), True
        self.base = recurrent.held(self.cache[:1]) - len(self.cached)

    def release(self, tokens: Optional[list[int]]) -> None:
        """Hand the caller's cache back holding `tokens` after its unknown prefix, as mlx-lm leaves it (with None,
        a step was cut: the rows known right); then take a fresh cache, so no later call touches the caller's."""
        for c in self.cache:  # rows a cut forward added and no verify trimmed
            if recurrent.held([c]) > self.base + len(self.cached):
                c.trim(recurrent.held([c]) - self.base - len(self.cached))
        if tokens is not None:
            self.hold(tokens)
        mx.eval([c.state for c in self.cache])  # (a cut forward's graph exists on this thread only)
        self.reset()

    def reset(self) -> None:
        """A fresh, empty cache of our own."""
        self.cache, self.cached, self.base, self.adopted = trimmable_cache(self.model), [], 0, False

    # --- the cache's doors for the server (prefix cache, batch moves); each runs on the target's thread

    def own_tokens(self) -> Optional[list[int]]:
        """The tokens the cache holds when it is our own and they are all known (not a caller's prompt
        cache, no prefix of unknown tokens), else None."""
        return None if self.adopted or self.base else list(self.cached)

    def give(self, held: list[int]) -> Optional[list[LayerCache]]:
        """Hand our cache away if it holds exactly `held` (every layer at that offset), else None; either
        way we go on with a fresh one."""
        ok = self.own_tokens() == held and all(c.offset == len(held) for c in self.cache)
        cache = self.cache if ok else None
        self.reset()
        return cache

    def take(self, cache: list[LayerCache], tokens: list[int]) -> None:
        """`cache` (holding `tokens`) becomes our own."""
        self.cache, self.cached, self.base, self.adopted = cache, list(tokens), 0, False

    def copy(self) -> Optional[tuple[list[int], list[LayerCache]]]:
        """A deep copy of our own cache and the tokens it holds, or None (nothing held, or not our own)."""
        tokens = self.own_tokens()
        return (tokens, copy.deepcopy(self.cache)) if tokens else None

    def hold(self, tokens: Sequence[int], step_size: int = 2048,
             progress: Optional[Callable[[int, int], None]] = None, top: int = 0) -> int:
        """Make the cache hold `tokens` (the longest cached prefix reused); the tokens run. With `top`, `self.seen`
        is (the tokens run, each one's top next ids, (n, top) numpy): what the recycled draft learns from."""
        tokens = list(tokens)
        keep = common_prefix(self.cached, tokens)
        if keep < len(self.cached) and not recurrent.can_drop(self.cache, len(self.cached) - keep):
            if self.adopted:
                raise ValueError("the prompt cache's recurrent state cannot drop its last "
                                 f"{len(self.cached) - keep} tokens: give a prompt that extends the cached one")
            keep = 0  # recurrent state holds no earlier point than its recent forwards: the tokens again, from none
            self.cache, self.cached = trimmable_cache(self.model), []
        if keep < len(self.cached):
            trim_prompt_cache(self.cache, len(self.cached) - keep)
        new, seen = tokens[keep:], []
        for i in range(0, len(new), step_size):
            logits = self.model(mx.array([new[i : i + step_size]]), cache=self.cache)
            if top:
                seen.append(top_ids(logits[0], top))
            mx.eval([c.state for c in self.cache], seen)
            if progress is not None:
                progress(min(i + step_size, len(new)), len(new))
        self.cached = tokens
        self.seen = (new, np.concatenate([np.array(s) for s in seen])) if seen else None
        return len(new)

    def time_widths(self, widths: Sequence[int], k: int, repeats: int = 3) -> dict[int, float]:
        """Seconds of a tree verify of each width (rows) after the cache, as `verify_tree` runs it (the median of
        `repeats`; the rows are dropped again): what a tree of that many rows costs here, on this thread."""
        last, seconds = (self.cached or [0])[-1], {}
        for w in widths:
            tree, runs = trees.build(last, [(0, last, "", None)] * (w - 1)), []  # the root and w - 1 children
            for _ in range(repeats):
                t0 = time.perf_counter()
                mx.eval(top_ids(trees.forward(self.model, self.cache, tree), k))
                runs.append(time.perf_counter() - t0)
                trim_prompt_cache(self.cache, w)
            seconds[w] = sorted(runs)[repeats // 2]
        return seconds

    def prefix(self, rows: list[int], kappa: int, exclude: Optional[list[int]],
               post: Callable[[list[list[int]], ExitView], None]) -> list[list[int]]:
        """Blocks 1..ℓ_e over the rows; `post`s the early-exit top-κ sets C_0..C_γ at once (with the exit's
        probabilities, for the branch budget), returns them."""
        early, self._final = self.tap.forward(mx.array([rows]), self.cache)
        ids, logprobs = top_k(early[0], kappa, exclude)
        own = drafted_logprobs(early[0], rows)
        mx.eval(ids, logprobs, own)
        self._ids = ids
        cand = int_rows(ids)
        post(cand, ExitView(float_rows(logprobs), floats(own)))
        return cand

    def suffix(self, history: list[int], window: list[int], sampler, processors) -> tuple[list[int], int, float]:
        """Blocks ℓ_e+1..N, then verify. Returns (target tokens, A, target mass inside C_A)."""
        ys, a, logits = self._verify(self._final, history, window, sampler, processors)
        assert self._ids is not None, "prefix first"
        probs = mx.softmax(logits[a].astype(mx.float32), axis=-1)
        omega = scalar(mx.take(probs, self._ids[a]).sum())
        self._final = self._ids = None
        return ys, a, omega

    def verify(self, history: list[int], window: list[int], sampler, processors) -> tuple[list[int], int]:
        """One plain forward over [pending, window], then verify (sd and ar)."""
        logits = self.model(mx.array([[history[-1]] + window]), cache=self.cache)
        ys, a, _ = self._verify(logits, history, window, sampler, processors)
        return ys, a

    def verify_tree(self, history: list[int], tree: trees.Tree, sampler, processors,
                    k: int) -> tuple[trees.Walk, np.ndarray]:
        """One forward over the tree (node 0 the pending token), then the walk; the cache keeps the committed
        path only. Returns the walk and every node's top-k next ids by the target's raw logits ((n, k) numpy)."""
        before = None if tree.is_chain else self.cache[0].offset
        logits = trees.forward(self.model, self.cache, tree)
        out = trees.walk(logits, tree, history, sampler, processors)
        top = top_ids(logits, k)
        mx.eval(top, out.logprobs)
        if before is None:
            trim_prompt_cache(self.cache, len(tree) - 1 - len(out.path))
        else:
            trees.keep_path(self.cache, before, [0] + out.path)
        self.cached = list(history) + out.tokens[:-1]
        self.logprobs = out.logprobs
        return out, np.array(top)

    def _verify(self, logits, history, window, sampler, processors):
        logits = logits[0]
        ys, self.logprobs = sample_rows(logits, history, window, sampler, processors)
        mx.eval(self.logprobs)  # (computed along with ys) kept for the committed tokens' Step.logprobs
        a = accept(window, ys)
        trim_prompt_cache(self.cache, len(window) - a)
        self.cached = list(history) + window[:a]
        return ys, a, logits

    def close(self) -> None:
        if self.tapped is not None:
            self.tapped.remove()
            self.tapped = None


class StageTargetSide(TargetSide):
    """The target split by layers across ranks (mlx-lm's pipeline split; docs/design.md §8): the rank whose stage
    holds block ℓ_e takes the early exit and top-κ and shares them with one all_sum that only it fills, so
    every rank posts or mirrors the same sets. The stages before the exit's (higher ranks) first evaluate their
    last cache, which depends on the send of their output, so the exit's rank never waits on one waiting on it."""

    def __init__(self, model: nn.Module, group: mx.distributed.Group, n_layers: int):
        super().__init__(model)
        inner = text_model(model).model
        self.group, self.n_layers = group, n_layers
        self.first, self.count = inner.start_idx, len(inner.pipeline_layers)
        self.vocab = vocab_size(model)
        self.exit_rank = 0  # the rank whose stage holds block ℓ_e

    def set_exit_layer(self, exit_layer: int, head: Optional[Callable] = None) -> None:
        mine = self.first < exit_layer <= self.first + self.count
        self.exit_rank = integer(mx.distributed.all_sum(mx.array(self.group.rank() if mine else 0), group=self.group,
                                                        stream=mx.cpu))
        if self.tapped is not None and (not mine or self.tapped.exit_layer != exit_layer
                                        or self.tapped.adapter is not head):
            self.tapped.remove()
            self.tapped = None
        if mine and self.tapped is None:
            self.tapped = EarlyExitTarget(self.model, exit_layer, head, self.n_layers, self.first)

    def prefix(self, rows: list[int], kappa: int, exclude: Optional[list[int]],
               post: Callable[[list[list[int]], ExitView], None]) -> list[list[int]]:
        x, rank = mx.array([rows]), self.group.rank()
        k = min(kappa, self.vocab or kappa)
        flat = mx.zeros((len(rows), k), dtype=mx.int32)
        probs = mx.zeros((len(rows), k + 1), dtype=mx.float32)  # the exit's log-probs: candidates, drafted token
        if rank == self.exit_rank:
            early, self._final = self.tap.forward(x, self.cache)
            flat, logprobs = top_k(early[0], kappa, exclude)
            flat = flat.astype(mx.int32)
            probs = mx.concatenate([logprobs, mx.pad(drafted_logprobs(early[0], rows), (0, 1))[:, None]], axis=1)
            mx.eval(flat, probs)
        else:
            self._final = self.model(x, cache=self.cache)
            if rank > self.exit_rank:  # an earlier stage: its layers and its send first
                mx.eval(self.cache[-1].state)
        ids = mx.distributed.all_sum(flat, group=self.group, stream=mx.cpu)
        probs = mx.distributed.all_sum(probs, group=self.group, stream=mx.cpu)
        mx.eval(ids, probs)
        self._ids = ids
        cand, exit_probs = int_rows(ids), float_rows(probs)
        post(cand, ExitView([row[:-1] for row in exit_probs], [row[-1] for row in exit_probs[:-1]]))
        return cand
