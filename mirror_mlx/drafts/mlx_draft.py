"""A plain mlx-lm model as draft (η̄ = 1): batched greedy rollouts over a shared committed prefix.

The engine's stems are spine-shaped (stem = ŷ_1..ŷ_r + [v], every stem minus its last token a prefix of one
spine ŷ). The spine is fed once on the committed cache; every branch is then one row of `BranchRows`, and all
rows advance together, one token per forward, lazily. The spine is then trimmed again: the draft's own cache
keeps committed tokens only.
"""

from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, KVCache, trim_prompt_cache

from ..engine import recurrent
from ..engine.recurrent import LayerCache
from .api import Rollout
from ..engine.model_parts import common_prefix, trimmable_cache, vocab_size
from ..engine.readback import int_rows, ints


def check_stems(stems: Sequence[Sequence[int]]) -> None:
    """Every draft's rule for a rollout's stems: at least one, none empty (ValueError otherwise)."""
    if not stems or any(len(s) == 0 for s in stems):
        raise ValueError("rollout needs at least one stem and every stem must be non-empty")


def spine_of(stems: Sequence[Sequence[int]]) -> list[int]:
    """The shared spine of spine-shaped stems (ValueError for anything else)."""
    check_stems(stems)
    spine = list(max(stems, key=len)[:-1])
    for s in stems:
        if list(s[:-1]) != spine[: len(s) - 1]:
            raise ValueError("stems must share one spine: each stem minus its last token a prefix of it")
    return spine


def self_verify(fed: Sequence[int], pred: Sequence[int]) -> tuple[int, list[int]]:
    """Speculative Streaming's self-verification (docs/design.md §5.4) of one chain fed in one forward, as both
    SS hosts (ss/draft.py, the Core ML package_host.py) verify: fed = [main token, guess_1, .., guess_k],
    pred[i] the main prediction after fed[:i+1]. Returns (keep, fed[1:keep+1] + [pred[keep]]), the tokens
    gained: the agreeing guesses, then the main prediction after them."""
    keep = 0
    while keep + 1 < len(fed) and fed[keep + 1] == pred[keep]:
        keep += 1
    return keep, [int(t) for t in fed[1 : keep + 1]] + [int(pred[keep])]


class MLXDraft:
    """Greedy draft over an mlx-lm model; its cache holds committed tokens only."""

    def __init__(self, model: nn.Module, prefill_step_size: int = 512):
        self.model = model
        self.prefill_step_size = prefill_step_size
        self.reset()  # first: a model whose cache cannot roll back is refused here, saying why
        self.vocab_size = vocab_size(model)

    def reset(self) -> None:
        self.cache: list[LayerCache] = trimmable_cache(self.model)
        self.cached: list[int] = []
        self.rows: list[Optional[BranchRows]] = []  # branch scratch per layer cache (None: recurrent), kept
        self.rows_valid = 0  # leading cache slots whose keys/values the rows hold as they are

    def sync(self, context: Sequence[int], extra: Sequence[int] = ()) -> int:
        """Make the cache hold exactly `context` (+ `extra`); the forwards that took (0 when nothing was new)."""
        self._trim_to(common_prefix(self.cached, context))
        return self._feed(list(context[len(self.cached):]) + list(extra))

    def _trim_to(self, n: int) -> None:
        self.rows_valid = min(self.rows_valid, n)
        if n < len(self.cached) and not recurrent.can_drop(self.cache, len(self.cached) - n):
            self.reset()  # recurrent state holds no earlier point than its recent forwards: fed again from none
        if n < len(self.cached):
            trim_prompt_cache(self.cache, len(self.cached) - n)
            del self.cached[n:]

    def _feed(self, tokens: list[int]) -> int:
        for i in range(0, len(tokens), self.prefill_step_size):
            self.model(mx.array([tokens[i : i + self.prefill_step_size]]), cache=self.cache)
            mx.eval([c.state for c in self.cache])
        self.cached.extend(tokens)
        return -(-len(tokens) // self.prefill_step_size)

    def rollout(self, context: Sequence[int], stems: Sequence[Sequence[int]], gamma: int) -> Rollout:
        if len(stems) == 1 and gamma > 0:
            check_stems(stems)
            return self._window(context, stems[0], gamma)
        spine = spine_of(stems)
        fed = self.sync(context, extra=spine)  # new context and the shared spine in one forward
        if self.cached:
            rows = self._branch_rows(len(context), [len(s) - 1 for s in stems], gamma)
        else:  # nothing before the stems (a one-token prompt): the branches share no slot, a fresh batched cache
            rows = trimmable_cache(self.model)
        self._trim_to(len(context))  # the draft's own cache keeps committed tokens only
        y = mx.array([[s[-1]] for s in stems], dtype=mx.int32)
        out = []
        for _ in range(gamma):  # lazy: each forward takes the previous argmax unevaluated
            y = mx.argmax(self.model(y, cache=rows)[:, -1, :], axis=-1, keepdims=True).astype(mx.int32)
            mx.async_eval(y)
            out.append(y)
        windows = int_rows(mx.concatenate(out, axis=1)) if out else [[] for _ in stems]
        return Rollout(windows=windows, forwards=gamma + fed, tokens=gamma)

    def _window(self, context: Sequence[int], stem: Sequence[int], gamma: int) -> Rollout:
        """One window (sd's, a fallback's) as mlx-lm's speculative decoding drafts it: what is new in the
        context and the stem in the first of γ forwards on the draft's own cache, then trimmed back to
        the context (no branch scratch, no extra forward for the new tokens)."""
        self._trim_to(common_prefix(self.cached, context))
        new = list(context[len(self.cached):])
        head = new[: max(0, len(new) - self.prefill_step_size)]  # a long context: its head in chunks first
        fed = self._feed(head)
        rest = new[len(head):]
        y = mx.argmax(self.model(mx.array([rest + list(stem)]), cache=self.cache)[:, -1, :], axis=-1, keepdims=True)
        out = [y]
        for _ in range(gamma - 1):  # lazy: each forward takes the previous argmax unevaluated
            mx.async_eval(y)
            y = mx.argmax(self.model(y.astype(mx.int32), cache=self.cache)[:, -1, :], axis=-1, keepdims=True)
            out.append(y)
        window = ints(mx.concatenate(out, axis=1)[0])
        trim_prompt_cache(self.cache, len(stem) + gamma - 1)  # the draft's cache keeps committed tokens only
        self.cached.extend(rest)
        return Rollout(windows=[window], forwards=fed + gamma, tokens=gamma)

    def _branch_rows(self, n: int, spine_used: list[int], gamma: int) -> list[Any]:
        """The branch rows over the cache (context + spine), refreshing only the slots that changed. Each
        attention layer's are BranchRows (kept); a recurrent layer's hold its state at each stem's end,
        rebuilt per rollout (a state per row, no slots); a CacheList (falcon_h1) gets one of its own of both."""
        B, S = len(spine_used), len(self.cached)
        leaves = recurrent.leaves(self.cache)
        rows, keep = self.rows, self.rows_valid
        kv = next((r for r in rows if r is not None), None)
        if not rows or (kv is not None and (kv.keys.shape[0] < B or kv.keys.shape[2] < S + gamma)):
            cap = BranchRows.step * -(-(S + gamma) // BranchRows.step)
            keep = keep if kv is not None and kv.keys.shape[0] >= B else 0
            rows = [None if isinstance(x, recurrent.RecurrentCache)
                    else BranchRows.grow(old, x, max(B, old.keys.shape[0] if old else 0), cap, keep)
                    for old, x in zip(rows or [None] * len(leaves), leaves)]
        for r, x in zip(rows, leaves):
            if r is not None:
                r.start(x, keep, S, n, spine_used)
        self.rows, self.rows_valid = rows, S
        flat = iter([recurrent.branches(x, [n + u for u in spine_used]) if r is None else r
                     for r, x in zip(rows, leaves)])
        return [CacheList(*(next(flat) for _ in c.caches)) if isinstance(c, CacheList) else next(flat)
                for c in self.cache]


class BranchRows:
    """One layer's branch scratch, allocated once and reused by every rollout of a generation: row b holds the
    draft's cache (context + spine) in slots [0, S) and its own γ tokens after. A mask hides the spine past
    row b's stem, RoPE takes row b's own position from `offset`, and between rollouts only the slots whose
    tokens changed are copied again."""

    step = 256

    def __init__(self, keys: mx.array, values: mx.array):
        self.keys, self.values = keys, values
        self.B = self.S = self.t = 0

    @classmethod
    def grow(cls, old: Optional["BranchRows"], cache: KVCache, B: int, cap: int, keep: int) -> "BranchRows":
        k, v = cache.state[:2]
        new = cls(mx.zeros((B, k.shape[1], cap, k.shape[3]), k.dtype),
                  mx.zeros((B, v.shape[1], cap, v.shape[3]), v.dtype))
        if old is not None and keep:
            new.keys[:, :, :keep, :] = old.keys[:B, :, :keep, :]
            new.values[:, :, :keep, :] = old.values[:B, :, :keep, :]
        return new

    def start(self, cache: KVCache, m: int, S: int, n: int, spine_used: list[int]) -> None:
        """Copy slots [m, S) from the draft's cache into every row; row b's stem ends at n + spine_used[b]."""
        if m < S:
            k, v = cache.state[:2]
            self.keys[:, :, m:S, :] = k[:, :, m:S, :]
            self.values[:, :, m:S, :] = v[:, :, m:S, :]
        self.B, self.S, self.t = len(spine_used), S, 0
        self.lim = mx.array([n + u for u in spine_used])  # row b sees prefix slots < lim[b]

    @property
    def offset(self) -> mx.array:
        return self.lim + self.t  # RoPE position of each row's next token

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        i = self.S + self.t
        self.keys[: self.B, :, i : i + 1, :] = keys
        self.values[: self.B, :, i : i + 1, :] = values
        self.t += 1
        return self.keys[: self.B, :, : i + 1, :], self.values[: self.B, :, : i + 1, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None) -> mx.array:
        if N != 1:
            raise ValueError("branch rows advance one token per forward")
        j = mx.arange(self.S + self.t + 1)[None, :]
        lim = self.lim[:, None]
        mask = (j < lim) | (j >= self.S)
        if window_size is not None:
            pos = mx.where(j < self.S, j, lim + j - self.S)  # each slot's RoPE position in row b
            mask = mask & (lim + self.t - pos < window_size)
        return mask[:, None, None, :]
