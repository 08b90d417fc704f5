"""Rollback of recurrent state (SSM, gated delta, short convolutions): drop a forward's last rows exactly.

mlx-lm's ArraysCache holds only the state after the last token (slot 0: the short convolution's window,
slot 1: the SSM or gated-delta state), so a rejected draft token cannot be trimmed away. `RecurrentCache`
can: during each forward it keeps the convolution's padded input (seen by the layer's own nn.Conv1d, whose
class is swapped for a noting subclass) and the arguments and start state of the recurrent update (mlx-lm's
`gated_delta_update` or `ssm_update`, wrapped in the model's module). `trim(n)` reruns the update alone
over the kept rows with mlx-lm's own function: a plain forward costs as before, a rollback one recurrence
over the accepted rows, only when a window is cut (capturing every row's state inside the update measured
dearer: BENCHMARKS.md, "Recurrent rollback"). One mechanism for every family that calls these updates
(qwen3_next, qwen3_5, mamba2, nemotron_h, falcon_h1, lfm2, ...).

Only recent rows can be dropped: the last forward (up to MAX_FORWARD rows) and KEEP_ROWS rows before it.
A cut further back is refused (`droppable`; callers then prefill again), and a stored copy (deepcopy: the
server's prefix cache) is frozen (is_trimmable False), so mlx-lm's LRUPromptCache reuses it only as an
exact prefix. A family whose state other code updates (mamba's own scan, ...) is refused at load (`check`).
"""

import copy
import inspect
import sys
import threading
from dataclasses import dataclass, field
from functools import wraps
from typing import Callable, Optional, Protocol, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta, ssm
from mlx_lm.models.cache import ArraysCache, CacheList

MAX_FORWARD = 1024  # a longer forward (a prefill chunk) is a checkpoint: no earlier point can be restored
KEEP_ROWS = 64  # rows of the forwards before the last that stay droppable (their inputs are kept in memory)

# mlx-lm's recurrent updates: the function and its per-token arguments (sequence on axis 1)
UPDATES: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "gated_delta_update": (gated_delta.gated_delta_update, ("q", "k", "v", "a", "b", "mask")),
    "ssm_update": (ssm.ssm_update, ("hidden_states", "B", "C", "dt", "mask")),
}

_touched = threading.local()  # the RecurrentCache whose slot the model read or set last (this thread)


class LayerCache(Protocol):
    """One layer's prompt cache as the pair rolls it back (mlx-lm's KVCache, a RecurrentCache, a CacheList of
    such): its arrays, the tokens it holds, and its last tokens dropped."""

    offset: int

    @property
    def state(self) -> object: ...

    def is_trimmable(self) -> bool: ...

    def trim(self, n: int) -> int: ...


@dataclass
class _Conv:
    padded: mx.array  # the window before the forward, then its rows: (B, n_keep + T, C)
    n_keep: int

    def after(self, rows: int) -> mx.array:
        return self.padded[:, rows : rows + self.n_keep, :]

    def first(self, rows: int) -> "_Conv":
        return _Conv(self.padded[:, : self.n_keep + rows], self.n_keep)


@dataclass
class _Update:
    fn: Callable
    args: dict  # the update's bound arguments, `state` the state before the forward
    per_token: tuple[str, ...]

    def after(self, rows: int) -> Optional[mx.array]:
        return self.fn(**self.first(rows).args)[1] if rows else self.args.get("state")

    def first(self, rows: int) -> "_Update":
        """The update over its first `rows` rows only."""
        args = {k: (v[:, :rows] if k in self.per_token and v is not None else v) for k, v in self.args.items()}
        return _Update(self.fn, args, self.per_token)


@dataclass
class _Forward:
    rows: int
    slots: dict = field(default_factory=dict)  # slot -> _Conv | _Update
    set: set = field(default_factory=set)  # slots the model set in this forward


class RecurrentCache(ArraysCache):
    """An ArraysCache whose recent forwards can be dropped (see the module's doc); `offset` counts tokens."""

    def __init__(self, size: int):
        super().__init__(size)
        self._offset = 0
        self.recent: list[_Forward] = []  # newest last: the last forward, and KEEP_ROWS rows before it
        self.frozen = False  # a stored copy (deepcopy): exact at its point, no rows to drop (is_trimmable False)
        self._open: Optional[_Forward] = None

    @classmethod
    def of(cls, cache: ArraysCache, offset: int = 0) -> "RecurrentCache":
        """mlx-lm's ArraysCache as one of ours (its state as is, after `offset` tokens)."""
        new = cls(len(cache.cache))
        new.cache, new.left_padding, new.lengths = list(cache.cache), cache.left_padding, cache.lengths
        new._offset = offset
        return new

    @property
    def offset(self) -> int:
        """Tokens the state has seen."""
        self._close()
        return self._offset

    def __getitem__(self, idx):
        _touched.cache, _touched.slot, _touched.set = self, idx, False
        return self.cache[idx]

    def __setitem__(self, idx, value):
        _touched.cache, _touched.slot, _touched.set = self, idx, True
        self.cache[idx] = value
        self._forward().set.add(idx)

    def _forward(self) -> _Forward:
        if self._open is None:
            self._open = _Forward(0)
        return self._open

    def _note(self, slot: int, record: "Union[_Update, _Conv]", rows: int) -> None:
        f = self._forward()
        if slot in f.slots:  # a second forward before the first closed (a layer without the other slot)
            self._close()
            f = self._forward()
        f.slots[slot], f.rows = record, rows
        if len(f.slots) == len(self.cache):
            self._close()

    def _close(self) -> None:
        f, self._open = self._open, None
        if f is None or not f.rows:
            return
        self._offset += f.rows
        if f.rows > MAX_FORWARD or f.set - set(f.slots):
            self.recent = []  # a checkpoint: nothing before it can be restored
            if f.set - set(f.slots):
                self.recent = [f]  # (unreached slots: `unreached` names them; no trim possible)
            return
        self.recent.append(f)
        while len(self.recent) > 1 and sum(r.rows for r in self.recent[:-1]) > KEEP_ROWS:
            self.recent.pop(0)

    def droppable(self) -> int:
        """How many of the last tokens `trim` can drop."""
        self._close()
        if any(f.set - set(f.slots) for f in self.recent):
            return 0
        return sum(f.rows for f in self.recent)

    def is_trimmable(self) -> bool:
        return not self.frozen

    def trim(self, n: int) -> int:
        """Drop the last `n` tokens exactly; ValueError past what the recent forwards can restore."""
        if n <= 0:
            return 0
        if n > self.droppable():
            raise ValueError(f"a recurrent layer's state can drop its last {self.droppable()} tokens, not {n}")
        left = n
        while left:
            f = self.recent[-1]
            keep = max(0, f.rows - left)
            for slot, rec in f.slots.items():
                self.cache[slot] = rec.after(keep)
            left -= f.rows - keep
            if keep == 0:
                self.recent.pop()
            else:
                f.slots = {s: rec.first(keep) for s, rec in f.slots.items()}
                f.rows = keep
        self._offset -= n
        return n

    def state_after(self, n: int) -> list:
        """The slots' values after the first `n` tokens the cache holds (n ≥ offset - droppable), lazily;
        the cache is unchanged."""
        self._close()
        twin = copy.copy(self)
        twin.cache, twin.recent = list(self.cache), [copy.copy(f) for f in self.recent]
        twin.trim(self._offset - n)
        return twin.cache

    def __deepcopy__(self, memo):
        self._close()
        new = RecurrentCache(len(self.cache))
        new.cache = [copy.deepcopy(c, memo) for c in self.cache]
        new._offset, new.frozen = self._offset, True
        return new

    def unreached(self) -> list[int]:
        """Slots the model set in its last forward that no noted update restores."""
        self._close()
        return sorted(set().union(*(f.set - set(f.slots) for f in self.recent))) if self.recent else []


def _take_touched() -> tuple[Optional[RecurrentCache], Optional[int], bool]:
    """The cache slot the model touched last on this thread (and whether it set it), once."""
    cache: Optional[RecurrentCache] = getattr(_touched, "cache", None)
    slot: Optional[int] = getattr(_touched, "slot", None)
    was_set = bool(getattr(_touched, "set", False))
    _touched.cache = _touched.slot = None
    return cache, slot, was_set


def _noting_update(fn: Callable, per_token: tuple[str, ...]) -> Callable:
    sig = inspect.signature(fn)

    @wraps(fn)
    def update(*args, **kwargs):
        cache, slot, _ = _take_touched()
        bound = sig.bind(*args, **kwargs)
        state = bound.arguments.get("state")
        out = fn(*args, **kwargs)
        if cache is not None and cache.cache[slot] is state and not cache.frozen:
            rows = next(bound.arguments[k] for k in per_token if bound.arguments.get(k) is not None).shape[1]
            cache._note(slot, _Update(fn, dict(bound.arguments), per_token), rows)
        return out

    return update


_WRAPPED = {name: _noting_update(fn, per_token) for name, (fn, per_token) in UPDATES.items()}


class _NotingConv1d(nn.Conv1d):
    def __call__(self, x):
        # the window the layer has just set (its last rows): a slot read, or a state, is some other layer's
        cache, slot, was_set = _take_touched()
        window = cache.cache[slot] if cache is not None and was_set and not cache.frozen else None
        if window is not None and window.ndim == 3 and window.shape[0] == x.shape[0] \
                and window.shape[2] == x.shape[2] and x.shape[1] > window.shape[1]:
            cache._note(slot, _Conv(x, window.shape[1]), x.shape[1] - window.shape[1])
        return super().__call__(x)


def install(model: nn.Module) -> None:
    """Make `model`'s recurrent layers note what a rollback needs (idempotent; a no-op for a model without
    them): its modules' update functions wrapped, its nn.Conv1d layers swapped for the noting subclass.
    Outside a RecurrentCache both behave exactly as before (mlx-lm's own caches see no change)."""
    for module in {sys.modules.get(type(m).__module__) for _, m in model.named_modules()}:
        for name, wrapped in _WRAPPED.items():
            if module is not None and getattr(module, name, None) is UPDATES[name][0]:
                setattr(module, name, wrapped)
    for _, m in model.named_modules():
        if type(m) is nn.Conv1d:
            m.__class__ = _NotingConv1d


def convert(cache: list, offset: int = 0) -> list:
    """mlx-lm's cache list with each ArraysCache (also inside a CacheList) made a RecurrentCache, in place."""
    for i, c in enumerate(cache):
        if isinstance(c, CacheList):
            c.caches = tuple(_one(x, offset) for x in c.caches)
        else:
            cache[i] = _one(c, offset)
    return cache


def plain(cache: Sequence[LayerCache]) -> list:
    """A copy of the list with mlx-lm's own classes only (RecurrentCache as ArraysCache), for its files."""
    def one(c):
        if isinstance(c, CacheList):
            return CacheList(*(one(x) for x in c.caches))
        if isinstance(c, RecurrentCache):
            new = ArraysCache(len(c.cache))
            new.cache = list(c.cache)
            return new
        return c
    return [one(c) for c in cache]


def _one(c: LayerCache, offset: int) -> LayerCache:
    if isinstance(c, RecurrentCache):
        c.frozen = False  # a stored copy in use again: it can drop the rows of forwards made from now on
        return c
    if type(c) is ArraysCache:
        return RecurrentCache.of(c, offset)
    return c


def held(cache: Sequence[LayerCache], default: int = 0) -> int:
    """Tokens a cache list holds, from its first layer that counts them (mlx-lm's ArraysCache does not)."""
    return next((int(x.offset) for x in leaves(cache) if hasattr(x, "offset") and type(x) is not ArraysCache),
                default)


def convertible(c: LayerCache) -> bool:
    """A layer cache `convert` makes droppable: mlx-lm's ArraysCache, or a CacheList of such and trimmable ones."""
    if isinstance(c, CacheList):
        return all(x.is_trimmable() or convertible(x) for x in c.caches)
    return type(c) is ArraysCache or isinstance(c, RecurrentCache)


def leaves(cache: Sequence[LayerCache]) -> list:
    """Every layer cache of a list, CacheLists opened."""
    return [x for c in cache for x in (c.caches if isinstance(c, CacheList) else (c,))]


def layers(cache: Sequence[LayerCache]) -> list[RecurrentCache]:
    """The RecurrentCaches in a cache list (inside CacheLists too)."""
    return [x for x in leaves(cache) if isinstance(x, RecurrentCache)]


def branches(c: RecurrentCache, points: Sequence[int]) -> ArraysCache:
    """A batched ArraysCache whose row b holds `c`'s state after its first points[b] tokens (a branch's start)."""
    states = {p: c.state_after(p) for p in set(points)}
    out = ArraysCache(len(c.cache))
    for s in range(len(c.cache)):
        rows = [states[p][s] for p in points]
        out[s] = None if any(r is None for r in rows) else mx.concatenate(rows, axis=0)
    return out


def can_drop(cache: Sequence[LayerCache], n: int) -> bool:
    """Every recurrent layer can drop the last `n` tokens (with none, any number can)."""
    return n <= min((c.droppable() for c in layers(cache)), default=n)


def check(model: nn.Module, cache: list, family: str) -> None:
    """Refuse (ValueError naming the family) a model whose recurrent state some update we do not note sets:
    a two-token forward on a throwaway copy of the fresh cache, then every set slot must be restorable."""
    if not layers(cache):
        return
    probe = copy.deepcopy(cache)
    convert(probe)
    model(mx.array([[0, 0]]), cache=probe)
    for c in layers(probe):
        if c.unreached() or not c.recent:
            raise ValueError(
                f"this {family} model's recurrent state is updated by code mirror-mlx cannot roll back (only "
                f"mlx-lm's {', '.join(UPDATES)} and short nn.Conv1d windows are), and every mode rolls its cache "
                "back (to reuse a prompt's prefix; speculation also drops the draft's rejected tokens): as a "
                "target, generate with mlx_lm.generate; as a draft, choose a model of another family")
