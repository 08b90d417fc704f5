"""What both sides of a pair read of an mlx-lm model, and nothing more: its text model, vocabulary and family,
a prompt cache whose every layer can drop its last tokens, and how far two token lists agree. The target side
(target.py) and the drafts (drafts/) import it; the draft host's process needs no more than this of a model.
"""

from typing import Optional, Sequence, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from . import recurrent
from .recurrent import LayerCache


def text_model(model: nn.Module) -> nn.Module:
    """The language model inside a VLM wrapper (gemma3, mistral3, ...), or the model itself."""
    return cast(nn.Module, getattr(model, "language_model", model))  # (mlx's stub: a Module's attribute is Any | dict)


def inner_model(model: nn.Module) -> nn.Module:
    """The module that holds the blocks (mlx-lm calls it `model`, or `backbone` in the SSM families)."""
    tm = text_model(model)
    return next((m for m in (getattr(tm, "model", None), getattr(tm, "backbone", None)) if m is not None), tm)


def vocab_size(model: nn.Module) -> Optional[int]:
    """Rows of the input embedding: token ids at or above it are out of range (and may crash MLX)."""
    inner = inner_model(model)
    embed = getattr(inner, "embed_tokens", None)
    weight = getattr(embed if embed is not None else getattr(inner, "embeddings", None), "weight", None)
    if weight is not None and weight.ndim == 2:
        return int(weight.shape[0])
    return getattr(getattr(text_model(model), "args", None), "vocab_size", None)


def family(model: nn.Module) -> str:
    """The model's mlx-lm family (its model_type), for messages."""
    tm = text_model(model)
    return getattr(getattr(tm, "args", None), "model_type", None) or type(tm).__module__.rsplit(".", 1)[-1]


def trimmable_cache(model: nn.Module) -> list[LayerCache]:
    """The model's prompt cache with every layer able to drop its last tokens: sliding-window layers get a
    plain KVCache (mlx-lm's RotatingKVCache silently refuses to trim once full, mlx-lm #1914, and the mask
    still applies the window), recurrent ones a RecurrentCache (recurrent.py). Anything else: ValueError."""
    recurrent.install(model)
    cache = recurrent.convert([KVCache() if isinstance(c, RotatingKVCache) else c for c in make_prompt_cache(model)])
    if not getattr(model, "_rollback_checked", False):  # (a plain attribute: not a parameter)
        recurrent.check(model, cache, family(model))
        model._rollback_checked = True
    for c in cache:
        if not (hasattr(c, "is_trimmable") and c.is_trimmable()):
            raise ValueError(f"this {family(model)} model's {type(c).__name__} layers cannot drop rejected tokens, "
                             "and every mode of mirror-mlx rolls its caches back (to reuse a prompt's prefix; "
                             "speculation also drops the draft's rejected tokens): as a target, generate with "
                             "mlx_lm.generate; as a draft, choose another model")
    return cache


def flat(tree: object) -> list[tuple[str, mx.array]]:
    """mlx's tree_flatten of a module's parameters (or an optimizer's state): (dotted name, array) pairs."""
    return cast(list[tuple[str, mx.array]], tree_flatten(tree))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens `a` and `b` share from their start: what a cache holding `a` keeps for `b`."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
