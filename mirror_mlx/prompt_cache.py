"""mlx_lm.cache_prompt's files: read for `generate --prompt-cache-file`, written by `mirror-mlx cache-prompt`.

mlx-lm's file holds the target's keys and values for a prompt prefix, but not the prefix's token ids: the
target continues from it alone (mode ar, as mlx_lm.generate does), but the draft needs the tokens, so
`mirror-mlx cache-prompt` writes mlx-lm's format plus the ids in the metadata entry TOKENS (mlx-lm reads
such a file as its own). The same class carries stream_generate's `prompt_cache=` (origin "list": the
caller's make_prompt_cache list, whose ids are known when mirror-mlx's own calls filled it).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache, load_prompt_cache, save_prompt_cache

from .engine import recurrent
from .engine.model_parts import trimmable_cache
from .validate import BadValue

if TYPE_CHECKING:
    import mlx.nn as nn

TOKENS = "mirror_mlx_tokens"  # metadata entry: the cached prefix's token ids, as a JSON list
PARAM = "prompt_cache"  # what a refusal names (the command line: --prompt-cache-file)


@dataclass
class PromptCache:
    """The target's per-layer caches, the prefix's ids (None in mlx-lm's own files, and in a list mlx-lm
    filled) and the file's metadata; the prompt given with it follows the prefix. `origin`: "file" or "list"
    (stream_generate's prompt_cache=), for the errors' advice."""

    cache: list
    tokens: Optional[list[int]]
    metadata: dict
    origin: str = "file"

    @property
    def length(self) -> int:
        """Tokens the cache holds."""
        return recurrent.held(self.cache)

    @property
    def opaque(self) -> int:
        """Tokens the cache holds whose ids are unknown (the whole prefix of an mlx-lm file, else 0)."""
        return self.length if self.tokens is None else 0

    def prompt(self, ids: Sequence[int]) -> list[int]:
        """The prompt the engine runs after this cache: the prefix's ids when known, then `ids` (what
        follows the prefix). With unknown prefix ids, `ids` alone (the cache stands for the prefix)."""
        if not ids:
            raise BadValue("prompt", "the {prompt} after a prompt cache is empty: give the text that follows the "
                           "cached prefix")
        return list(self.tokens or []) + list(ids)

    def check(self, mode: str, n_layers: int) -> None:
        """Raise BadValue (param "prompt_cache", one sentence) when this cache cannot serve `mode` on a target of
        `n_layers`."""
        listed = self.origin == "list"
        if len(self.cache) != n_layers:
            raise BadValue(PARAM, "the {prompt_cache} holds {held} layers but the target has {n}: it was made for "
                           "another model" + (" (give make_prompt_cache(model) of the target alone: mirror-mlx keeps "
                                              "the draft's cache itself)" if listed else ""), held=len(self.cache),
                           n=n_layers)
        if mode == "ar":
            return
        if self.tokens is None:
            why = ("holds tokens that mirror-mlx did not put there (mlx-lm filled it): fill it only with "
                   "mirror_mlx.stream_generate/generate calls, from an empty make_prompt_cache(model)" if listed else
                   "has none (mlx_lm.cache_prompt's file): make it with `mirror-mlx cache-prompt` instead")
            raise BadValue(PARAM, "mode {asked!r} needs the cached prompt's token ids (the draft reads them) and this "
                           "{prompt_cache} " + why + ", or use {mode='ar'}", asked=mode)
        fixed = next((type(c).__name__ for c in self.cache if isinstance(c, RotatingKVCache)
                      or not (c.is_trimmable() or recurrent.convertible(c))), None)
        if fixed is not None:
            raise BadValue(PARAM, "the {prompt_cache} holds {fixed} layers, which cannot roll back rejected draft "
                           "tokens: use {mode='ar'}", fixed=fixed)


def read(path: str) -> PromptCache:
    """A prompt cache file (mlx-lm's or ours); BadValue (param "prompt_cache", one sentence) when it is not one."""
    if not Path(path).is_file():
        raise BadValue(PARAM, "prompt cache file {path} does not exist: make one with `mirror-mlx cache-prompt` "
                       "(or mlx_lm.cache_prompt)", path=path)
    try:
        cache, metadata = load_prompt_cache(str(path), return_metadata=True)
    except Exception as e:  # not safetensors, or safetensors without a cache's layout
        raise BadValue(PARAM, "{path} is not a prompt cache file (mlx_lm.cache_prompt's format): {why}", path=path,
                       why=f"{type(e).__name__}: {e}") from None
    if not cache or not (hasattr(cache[0], "offset") or recurrent.convertible(cache[0])):
        raise BadValue(PARAM, "{path} holds no key/value cache layers: it is not a prompt cache of a transformer",
                       path=path)
    mx.eval([c.state for c in cache])  # computed here: the target's worker thread cannot evaluate this graph
    tokens = None
    if TOKENS in metadata:
        try:
            tokens = [int(t) for t in json.loads(metadata[TOKENS])]
        except (ValueError, TypeError):
            raise BadValue(PARAM, "{path}: its {entry} entry is not a JSON list of token ids", path=path,
                           entry=TOKENS) from None
    found = PromptCache(recurrent.convert(cache, recurrent.held(cache, len(tokens or []))), tokens, metadata)
    if tokens is not None and len(tokens) != found.length:
        raise BadValue(PARAM, "{path} lists {listed} token ids but its cache holds {held} tokens: the file was "
                       "altered; make it again with `mirror-mlx cache-prompt`", path=path, listed=len(tokens),
                       held=found.length)
    return found


def write(path: str, model: "nn.Module", ids: Sequence[int], metadata: dict) -> PromptCache:
    """Run `ids` through the target as mlx_lm.cache_prompt does and save the cache with the ids."""
    cache = trimmable_cache(model)  # mlx-lm's make_prompt_cache, sliding-window layers plain (rollback)
    for _ in generate_step(mx.array(list(ids)), model, max_tokens=0, prompt_cache=cache):
        pass
    metadata = dict(metadata, **{TOKENS: json.dumps([int(t) for t in ids])})
    save_prompt_cache(str(path), recurrent.plain(cache), metadata)
    return PromptCache(cache, list(ids), metadata)
