"""A plain mlx-lm model as draft (η̄ = 1): batched greedy rollouts over a shared committed prefix.

The engine's stems are spine-shaped: stem = ŷ_1..ŷ_r + [v], every stem minus its last token a
prefix of one spine ŷ. The spine is fed once on the committed cache; every branch is then one
row of a left-padded `BatchKVCache` holding context + ŷ_1..ŷ_r (shifted right by γ − r masked
padding slots, so positions stay exact), and all rows advance together, one token per forward.
Afterwards the spine is trimmed again: the draft's own cache keeps committed tokens only.
"""

from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, trim_prompt_cache

from .draft_api import Rollout
from .target import text_model, trimmable_cache


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def spine_of(stems: Sequence[Sequence[int]]) -> list[int]:
    """The shared spine of spine-shaped stems (ValueError for anything else)."""
    if not stems or any(len(s) == 0 for s in stems):
        raise ValueError("rollout needs at least one stem and every stem must be non-empty")
    spine = list(max(stems, key=len)[:-1])
    for s in stems:
        if list(s[:-1]) != spine[: len(s) - 1]:
            raise ValueError("stems must share one spine: each stem minus its last token a prefix of it")
    return spine


class MLXDraft:
    """Greedy draft over an mlx-lm model; its cache holds committed tokens only."""

    def __init__(self, model: nn.Module, prefill_step_size: int = 512):
        self.model = model
        self.vocab_size = text_model(model).model.embed_tokens.weight.shape[0]
        self.prefill_step_size = prefill_step_size
        self.reset()

    def reset(self) -> None:
        self.cache: list[Any] = trimmable_cache(self.model)
        self.cached: list[int] = []

    def sync(self, context: Sequence[int], extra: Sequence[int] = ()) -> int:
        """Make the cache hold exactly `context` (+ `extra`): trim what diverged, feed what is new.

        Returns the forwards that took (0 when nothing was new).
        """
        self._trim_to(common_prefix(self.cached, context))
        return self._feed(list(context[len(self.cached):]) + list(extra))

    def _trim_to(self, n: int) -> None:
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
        spine = spine_of(stems)
        fed = self.sync(context, extra=spine)  # new context and the shared spine in one forward
        cache = self._branch_cache([len(spine) - (len(s) - 1) for s in stems])
        trim_prompt_cache(self.cache, len(spine))
        del self.cached[len(self.cached) - len(spine) :]
        y = mx.array([[s[-1]] for s in stems], dtype=mx.int32)
        out = []
        for _ in range(gamma):
            y = mx.argmax(self.model(y, cache=cache)[:, -1, :], axis=-1, keepdims=True).astype(mx.int32)
            mx.eval(y)
            out.append(y)
        windows = mx.concatenate(out, axis=1).tolist() if out else [[] for _ in stems]
        return Rollout(windows=windows, forwards=gamma + fed, tokens=gamma)

    def _branch_cache(self, pads: list[int]) -> list[BatchKVCache]:
        """Rows of the cache, row b shifted right by pads[b] masked slots (one gather per layer)."""
        S = len(self.cached)
        j = mx.arange(S)[None, :]
        p = mx.array(pads)[:, None]
        index = mx.where(j < p, 0, j - p + 1)  # slot 0 of the padded prefix is the zero pad
        caches = []
        for c in self.cache:
            bc = BatchKVCache(pads)
            if S > 0:
                bc.keys, bc.values = (_pad_rows(x[..., :S, :], index) for x in c.state[:2])
                bc.offset = bc.offset + S
                bc._idx = S
            caches.append(bc)
        mx.eval([(bc.keys, bc.values) for bc in caches if bc.keys is not None])
        return caches


def _pad_rows(x: mx.array, index: mx.array) -> mx.array:
    """(1, H, S, D) prefix → (B, H, S, D) rows, row b shifted right by its padding (zeros in front)."""
    padded = mx.concatenate([mx.zeros_like(x[..., :1, :]), x], axis=2)[0]  # (H, S+1, D)
    return mx.take(padded, index, axis=1).transpose(1, 0, 2, 3)  # (H, B, S, D) → (B, H, S, D)
