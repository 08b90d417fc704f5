"""The target's caches of recent requests, so a prefix sent again is not prefilled again."""

from typing import TYPE_CHECKING, Optional

from mlx_lm.models.cache import LRUPromptCache

from ..engine.model_parts import common_prefix
from ..engine.recurrent import convert

if TYPE_CHECKING:
    from ..engine import Engine
    from ..engine.target import TargetSide


class PrefixCache:
    """The target's caches of recent requests, in mlx-lm's LRUPromptCache (mlx_lm.server's
    --prompt-cache-size): a prompt that shares a longer prefix with one of them than with the engine's
    own cache (the last request's) starts from a copy of it, so a system prompt or a document sent
    again is not prefilled again. Only the target's cache is stored: the draft keeps its one cache and
    re-prefills from its common prefix with the prompt (a small model: cheap). Entries are exact (the
    target's own keys and values for those tokens), so the output is what a fresh run gives."""

    KEY = "target"

    def __init__(self, engine: "Engine", size: int, max_bytes: Optional[int] = None):
        self.engine = engine
        self.max_bytes = max_bytes
        self.lru = LRUPromptCache(size, max_bytes if max_bytes is not None else 1 << 63) if size > 0 else None
        self.dropped_for_batch = 0  # stored caches dropped to leave room for the active batch's

    def give_way(self, active_bytes: int) -> None:
        """Under --prompt-cache-bytes the stored caches and the active batch's share the limit (as
        mlx_lm.server): drop the oldest stored ones until both fit. Call on the target's thread."""
        if self.lru is not None and self.max_bytes is not None:
            held = len(self.lru)
            self.lru.trim_to(n_bytes=self.max_bytes - active_bytes)
            self.dropped_for_batch += held - len(self.lru)

    def health(self) -> dict:
        return {"entries": len(self.lru) if self.lru is not None else 0,
                "bytes": self.lru.nbytes if self.lru is not None else 0, "max_bytes": self.max_bytes,
                "dropped_for_batch": self.dropped_for_batch}

    def restore(self, ids: list[int]) -> int:
        """Before a request: start the target from the stored cache nearest `ids`; how many tokens it holds
        (0: the engine's own cache was as good)."""
        if self.lru is None:
            return 0
        return self.engine.with_target(self._restore, ids[:-1])  # (the last token runs in the first step)

    def _restore(self, target: "TargetSide", ids: list[int]) -> int:
        own = target.own_tokens()
        if own is None:
            return 0
        assert self.lru is not None, "restore checks there is a cache first"
        cache, rest = self.lru.fetch_nearest_cache(self.KEY, ids)
        held = len(ids) - len(rest)
        if cache is None or held <= common_prefix(own, ids):
            return 0

        target.take(convert(cache), ids[:held])  # (a stored recurrent copy: thawed)
        return held

    def store(self) -> None:
        """After a request: keep a copy of the target's cache, keyed by the tokens it holds."""
        if self.lru is not None:
            self.engine.with_target(self._store)

    def _store(self, target: "TargetSide") -> None:
        held = target.copy()
        assert self.lru is not None, "store checks there is a cache first"
        if held is not None:
            self.lru.insert_cache(self.KEY, *held)
