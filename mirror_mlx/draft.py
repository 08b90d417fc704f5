"""A plain mlx-lm model as draft (η̄ = 1): batched greedy rollouts over a shared committed prefix.

Every branch is one row of a left-padded `BatchKVCache`. Row b's cache holds the committed
prefix minus its last p_b tokens, shifted right by p_b padding slots; its block re-feeds those
p_b tokens and then its stem, so all rows have the same physical length and positions stay
exact (padding slots are masked). All branches then advance together, one token per forward.
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

    def sync(self, context: Sequence[int]) -> None:
        """Make the cache hold exactly `context`: trim what diverged, feed what is new."""
        keep = common_prefix(self.cached, context)
        if keep < len(self.cached):
            trim_prompt_cache(self.cache, len(self.cached) - keep)
            del self.cached[keep:]
        new = list(context[keep:])
        for i in range(0, len(new), self.prefill_step_size):
            self.model(mx.array([new[i : i + self.prefill_step_size]]), cache=self.cache)
            mx.eval([c.state for c in self.cache])
        self.cached.extend(new)

    def rollout(self, context: Sequence[int], stems: Sequence[Sequence[int]], gamma: int) -> Rollout:
        if not stems or any(len(s) == 0 for s in stems):
            raise ValueError("rollout needs at least one stem and every stem must be non-empty")
        self.sync(context)
        tokens, cache = self._branch_rows(stems)
        windows = []
        y = tokens
        for _ in range(gamma):
            logits = self.model(y, cache=cache)
            y = mx.argmax(logits[:, -1, :], axis=-1, keepdims=True).astype(mx.int32)
            mx.eval(y)
            windows.append(y)
        out = mx.concatenate(windows, axis=1).tolist() if windows else [[] for _ in stems]
        return Rollout(windows=out, forwards=gamma, tokens=gamma)

    def _branch_rows(self, stems: Sequence[Sequence[int]]) -> tuple[mx.array, list[BatchKVCache]]:
        """The (B, L) input block and the left-padded batch cache for the branch rows."""
        S = len(self.cached)
        L = max(len(s) for s in stems)
        pads = [L - len(s) for s in stems]
        rows = []
        for p, stem in zip(pads, stems):
            refeed = self.cached[max(0, S - p) :]
            rows.append([0] * max(0, p - S) + refeed + list(stem))
        caches = []
        for c in self.cache:
            bc = BatchKVCache(pads)
            if S > 0:
                k, v = c.state[0][..., :S, :], c.state[1][..., :S, :]
                ks, vs = [], []
                for p in pads:
                    q = min(p, S)
                    shape_k = (1, k.shape[1], q, k.shape[3])
                    shape_v = (1, v.shape[1], q, v.shape[3])
                    ks.append(mx.concatenate([mx.zeros(shape_k, k.dtype), k[..., : S - q, :]], axis=2))
                    vs.append(mx.concatenate([mx.zeros(shape_v, v.dtype), v[..., : S - q, :]], axis=2))
                bc.keys, bc.values = mx.concatenate(ks), mx.concatenate(vs)
                bc.offset = bc.offset + S
                bc._idx = S
            caches.append(bc)
        return mx.array(rows, dtype=mx.int32), caches
