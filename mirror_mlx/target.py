"""The target with an early-exit tap: one forward gives the logits at layer ℓ_e and at layer N.

No per-architecture code. Block ℓ_e's class is swapped for a subclass that records its output, and
the early head reuses the model's own final norm + head code by calling the outer model with an
inner model whose `__call__` only normalises the recorded state (ecosystem.md §1.3). Tied or
untied heads, logit soft-caps and logit scaling all come along for free.
"""

from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from .options import default_exit_layer


def text_model(model: nn.Module) -> nn.Module:
    """The language model inside a VLM wrapper (gemma3, mistral3, ...), or the model itself."""
    return getattr(model, "language_model", model)


class _Tap:
    """Holds the output of the tapped block for the forward in flight."""

    h: Optional[mx.array] = None


def _install_tap(block: nn.Module, tap: _Tap) -> type:
    cls = type(block)

    def __call__(self, *args, **kwargs):
        tap.h = cls.__call__(self, *args, **kwargs)
        return tap.h

    block.__class__ = type("Tapped" + cls.__name__, (cls,), {"__call__": __call__})
    return cls


def vocab_size(model: nn.Module) -> Optional[int]:
    """Rows of the input embedding: token ids at or above it are out of range (and may crash MLX)."""
    tm = text_model(model)
    embed = getattr(getattr(tm, "model", tm), "embed_tokens", None)
    weight = getattr(embed, "weight", None)
    if weight is not None and weight.ndim == 2:
        return int(weight.shape[0])
    return getattr(getattr(tm, "args", None), "vocab_size", None)


def check_exit_layer(exit_layer: int, n_layers: int) -> None:
    if not 1 <= exit_layer <= n_layers - 1:
        raise ValueError(
            f"exit layer {exit_layer} is outside 1..{n_layers - 1} for a target with {n_layers} layers "
            f"(choose a layer in that range, e.g. {default_exit_layer(n_layers)})"
        )


def trimmable_cache(model: nn.Module) -> list[Any]:
    """The model's prompt cache with every sliding-window layer given a plain KVCache.

    mlx-lm's RotatingKVCache silently refuses to trim once full (mlx-lm #1914); the window still
    applies through the attention mask, so a plain cache is exact and always trimmable.
    """
    cache = make_prompt_cache(model)
    cache = [KVCache() if isinstance(c, RotatingKVCache) else c for c in cache]
    for c in cache:
        if not (hasattr(c, "is_trimmable") and c.is_trimmable()):
            raise ValueError(
                f"{type(c).__name__} layers cannot be rolled back, so speculative decoding would be "
                "wrong: models with recurrent state (SSM, linear attention) are not supported"
            )
    return cache


class EarlyExitTarget:
    """An mlx-lm model tapped at block `exit_layer` (1-based count of blocks before the exit)."""

    def __init__(self, model: nn.Module, exit_layer: int, adapter: Optional[Callable] = None):
        self.model = model
        self.layers = text_model(model).layers
        check_exit_layer(exit_layer, len(self.layers))
        self.exit_layer = exit_layer
        self.adapter = adapter  # maps the normalised exit state before the head; never the final logits
        self._tap = _Tap()
        self._block_cls = _install_tap(self.layers[exit_layer - 1], self._tap)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def remove(self) -> None:
        """Undo the class swap (the model is then exactly as loaded)."""
        self.layers[self.exit_layer - 1].__class__ = self._block_cls

    def make_cache(self) -> list[Any]:
        return trimmable_cache(self.model)

    def forward(self, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """Build one forward over `tokens` (B, T); returns lazy (early_logits, final_logits).

        Evaluate the early logits first: that computes only embedding + blocks 1..ℓ_e + head.
        Evaluating the final logits afterwards reuses the block-ℓ_e result. The cache is updated once.
        """
        final = self.model(tokens, cache=cache)
        early = self.head(self._tap.h)
        self._tap.h = None
        return early, final

    def head(self, h: mx.array) -> mx.array:
        """The model's own final norm (+ adapter) and head applied to a hidden state."""
        x = text_model(self.model).model.norm(h)
        return apply_head(self.model, self.adapter(x) if self.adapter is not None else x)


def apply_head(model: nn.Module, x: mx.array) -> mx.array:
    """The model's own head (tied or not, soft-caps, logit scaling) on an already normalised state (B, T, D).

    The inner model's class is swapped for a subclass whose `__call__` returns `x`, and the outer
    model runs as usual: no per-architecture code.
    """
    tm = text_model(model)
    inner = tm.model
    cls = type(inner)
    inner.__class__ = type("Given" + cls.__name__, (cls,), {"__call__": lambda self_, *a, **k: x})
    try:
        return tm(mx.zeros(x.shape[:2], dtype=mx.int32))
    finally:
        inner.__class__ = cls


def top_k(logits: mx.array, k: int, exclude: Optional[list[int]] = None) -> tuple[mx.array, mx.array]:
    """Top-k ids and log-probs of each row of `logits` (T, V), sorted by probability.

    `exclude[r]` (or -1) is a token that row r must not propose: for window rows r < γ the
    correction can never be the draft token it rejected (docs/design.md §3 step 2, the excluded-token rule).
    """
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
