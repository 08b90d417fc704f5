"""Speculation inside the server's batch: each row proposes its own window (its prompt lookup over its own
context, or with the recycled draft the recycled chain: batch_proposals.py), the target verifies every row in
one forward over the batch's caches, and each row keeps exactly its own accepted tokens plus the target's token
after them. No row is cut back to another row's acceptance.

The windows are right-padded to the widest: a causal forward never lets a row's real positions see its padding.
After the verify each row's cache drops its own rejected positions: the fewest any row rejected are trimmed off
the shared end, the rest of each row's become holes its mask hides (`HoleKVCache`, mlx-lm's BatchKVCache with
a per-row mask of dropped positions; its RoPE offset drops by as many). So each row attends to exactly its
committed tokens but the pending one, as the engine's cache holds them (docs/design.md §6), and each row's
tokens are the target's own: argmax, or its sampler's draw keyed by (seed, position), matched against the
window (the sample-and-match rule of §6).

The width is chosen each step (`choose_width`) for the most committed tokens per second over all rows: the
verify's measured seconds by (rows, width) (`VerifyCost`) against each row's expected accepted tokens (its
proposer's acceptance so far). Width 1 is a plain batched decode step. A model whose caches are not all plain
KVCaches (recurrent state) or that has sliding-window layers batches through mlx-lm's BatchGenerator instead,
without speculation (`supports`).
"""

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, cast

import mlx.core as mx
import numpy as np
from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from ..proposers.lookup import MARGIN, NGRAM_MIN, ROW_COST, Lookup
from ..proposers.recycle import Recycled
from .batch_proposals import Proposals
from ..engine.model_parts import trimmable_cache
from ..engine.readback import int_rows, ints
from ..options import DecodeOptions
from ..engine.sampling import row_sampler, sample_rows, samplers
from ..engine.target import accept

if TYPE_CHECKING:
    import mlx.nn as nn

GAMMA = 8  # the longest window a row proposes (the lookup alone's, lookup.LOOKUP_GAMMA)
COMPACT = 64  # holes and padding beyond this many positions a row are squeezed out (rows that accepted less add them)


def supports(model: "nn.Module") -> tuple[bool, str]:
    """Whether the batch can speculate with this model (every layer a plain KVCache, whose rows can drop their
    own rejected positions as masked holes; no sliding window), and why not."""
    kinds = {type(c).__name__ for c in trimmable_cache(model) if type(c) is not KVCache}
    if kinds:
        return False, f"its {', '.join(sorted(kinds))} layers cannot drop a row's own rejected tokens in a batch"
    if any(isinstance(c, RotatingKVCache) for c in make_prompt_cache(model)):
        return False, "its sliding-window layers count their window in cache positions, which holes would shift"
    return True, ""


def choose_width(survivals: Sequence[Sequence[float]], seconds: Callable[[int], float], widest: int) -> int:
    """The verify width w (1 + the longest window) with the most expected committed tokens per second over all
    rows: at width w row i commits 1 + sum(survival_i[:w - 1]) on average (P(its first j tokens are right));
    a wider step must beat a plain one (w = 1) by MARGIN, as a lone lookup window must (lookup.best_length)."""
    best, rate = 1, MARGIN * len(survivals) / seconds(1)
    for w in range(2, widest + 1):
        r = sum(1 + sum(s[: w - 1]) for s in survivals) / seconds(w)
        if r > rate:
            best, rate = w, r
    return best


class VerifyCost:
    """Seconds per batched step by (rows, width): the running mean where measured; else a line through the
    measured sizes in the tokens they run (rows × width), a fixed part and a part per token; with one size
    measured, ROW_COST of it per token past the first (the lookup's prior)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, int], float] = {}
        self.times: dict[tuple[int, int], int] = {}

    def note(self, rows: int, width: int, seconds: float) -> None:
        """A step's seconds; a size's first one is replaced by its second (a new shape's first run allocates)."""
        key = (rows, width)
        n = self.times[key] = self.times.get(key, 0) + 1
        self.seen[key] = seconds if n <= 2 else 0.8 * self.seen[key] + 0.2 * seconds

    def seconds(self, rows: int, width: int) -> float:
        if (rows, width) in self.seen:
            return self.seen[(rows, width)]
        points = [(r * w, t) for (r, w), t in self.seen.items()]
        n = rows * width
        if len({x for x, _ in points}) >= 2:
            mx_, mt = sum(x for x, _ in points) / len(points), sum(t for _, t in points) / len(points)
            slope = sum((x - mx_) * (t - mt) for x, t in points) / sum((x - mx_) ** 2 for x, _ in points)
            slope = max(slope, 0.0)
            return max(mt + slope * (n - mx_), 1e-6)
        if points:
            x, t = points[0]
            return t * (1 + ROW_COST * (n - 1)) / (1 + ROW_COST * (x - 1))
        return 1 + ROW_COST * (n - 1)

    def as_dict(self) -> dict:
        return {f"{r}x{w}": round(t * 1e3, 3) for (r, w), t in sorted(dict(self.seen).items())}


class HoleKVCache(BatchKVCache):
    """mlx-lm's BatchKVCache whose rows can drop positions inside it: `drop` hides each row's last r_i positions
    from every later query (its mask) and lowers the row's RoPE offset by r_i, so its next token is numbered
    right after its kept ones. Moving a row's keys to drop them instead (mlx-lm's right-padding roll) costs a
    copy of the whole batch cache every step; a hole costs nothing until `compact` squeezes them out. `keep`
    (rows × positions, True where kept) covers the positions the cache held at the last drop; later ones are
    kept. Built from mlx-lm's own cache (`adopt`), so its prefill, merge and extend are mlx-lm's."""

    keep: Optional[mx.array] = None

    @classmethod
    def adopt(cls, cache: BatchKVCache) -> "HoleKVCache":
        c = cls([])
        c.state = cache.state
        return c

    def _kept(self, n: int) -> mx.array:
        """The keep mask over the first n positions (those past `keep` are kept)."""
        rows = self.offset.shape[0]
        if self.keep is None:
            return mx.ones((rows, n), dtype=mx.bool_)
        k = self.keep[:, :n]
        return k if k.shape[1] == n else mx.concatenate([k, mx.ones((rows, n - k.shape[1]), dtype=mx.bool_)], 1)

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        mask = super().make_mask(N, return_array=True, **kwargs)
        return mask if self.keep is None else mask & self._kept(self.size() + N)[:, None, None, :]

    def drop(self, rest: list[int]) -> None:
        """Row i's last rest[i] positions are hidden from now on; its offset drops by as many."""
        n = self.size()
        cols = mx.arange(n)[None, :]
        self.keep = self._kept(n) & (cols < (n - mx.array(rest))[:, None])
        self.offset = self.offset - mx.array(rest)

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if self.keep is not None:
            self.keep = self.keep[:, : self.size()]
        return n

    def filter(self, batch_indices) -> None:
        shift = min(ints(self.left_padding[mx.array(batch_indices)]))
        super().filter(batch_indices)
        if self.keep is not None:
            self.keep = self.keep[mx.array(batch_indices)][:, shift:]

    def extend(self, other: BatchKVCache) -> None:
        mine, theirs = self.size(), other.size()
        if self.keep is not None:
            rows = other.offset.shape[0]
            width = max(mine, theirs)
            kept = mx.pad(self._kept(mine), [(0, 0), (width - mine, 0)], constant_values=True)
            self.keep = mx.concatenate([kept, mx.ones((rows, width), dtype=mx.bool_)])
        super().extend(other)

    def extract(self, idx: int) -> KVCache:
        """Row idx's kept positions as a plain KVCache (holes and padding left out)."""
        cache = super().extract(idx)
        if self.keep is not None:
            pad = self.left_padding[idx].item()
            at = mx.array(np.flatnonzero(np.array(self._kept(self.size())[idx, pad:])))
            cache.keys, cache.values = mx.contiguous(cache.keys[:, :, at]), mx.contiguous(cache.values[:, :, at])
            cache.offset = cache.keys.shape[2]
        return cache

    def waste(self) -> int:
        """Positions every row leaves unused (padding and holes): what `compact` would save."""
        n = self.size()
        if self.keep is None:
            return min(ints(self.left_padding))
        used = (self._kept(n) & (mx.arange(n)[None, :] >= self.left_padding[:, None])).sum(axis=1)
        return n - max(ints(used))

    def compact(self) -> None:
        """Each row's kept positions moved to the end, in order; the rest becomes left padding (a gather of the
        whole cache: done only when the waste is worth it)."""
        n = self.size()
        kept = self._kept(n) & (mx.arange(n)[None, :] >= self.left_padding[:, None])
        counts = kept.sum(axis=1)
        width = max(ints(counts))
        # (position order within a row, kept ones last: a stable sort on "kept")
        order = mx.argsort(kept.astype(mx.int32) * (n + 1) + mx.arange(n)[None, :], axis=1)[:, n - width :]
        idx = order[:, None, :, None]
        keys, values = cast(mx.array, self.keys), cast(mx.array, self.values)  # (mlx-lm's stub: None, its start)
        self.state = (mx.take_along_axis(keys[..., :n, :], idx, axis=2), mx.take_along_axis(values[..., :n, :], idx,
                      axis=2), self.offset, width - counts, width)
        self.keep = None


@dataclass
class Row:
    """One request in the batch: its committed tokens (the cache holds all but the last, the pending token)."""

    uid: int
    tokens: list[int]
    left: int  # tokens it may still commit
    sample: Callable  # sampling.row_sampler: position-keyed draws
    processors: list
    greedy: bool  # mlx-lm's greedy sampler, no processors: the batch's argmax decides
    stops: frozenset
    lookup: Lookup
    cache: Optional[list] = None  # until it joins: its own cache of tokens[:held]
    held: int = 0

    @property
    def own_cache(self) -> list:
        """The cache of a row still joining (it has one until it joins)."""
        assert self.cache is not None, "a joined row's cache is the batch's"
        return self.cache


@dataclass
class Out:
    """What one row committed in a step; with `finish`, its cache and the tokens it holds (for the prefix cache)."""

    uid: int
    tokens: list[int]
    drafted: list[bool]  # each token was a window's (accepted), else the target's own at the correction
    logprobs: list
    finish: Optional[str] = None
    cache: Optional[list] = None
    all_tokens: Optional[list[int]] = None


class SpecBatch:
    """The server's batch with speculation: rows join (prefilled together, as mlx-lm's BatchGenerator prefills)
    and leave between steps; each step verifies every row's window in one forward. Call on the target's thread.
    `recycled`: the recycled draft's table (the engine's, so solo and batched generations learn in one), else
    the rows propose the lookup's windows alone."""

    def __init__(self, model: "nn.Module", prompt_concurrency: int = 8, prefill_step_size: int = 2048,
                 gamma: int = GAMMA, recycled: Optional[Recycled] = None):
        self.model, self.prompt_concurrency, self.prefill_step_size, self.gamma = \
            model, prompt_concurrency, prefill_step_size, gamma
        self.rows: list[Row] = []
        self.joining: list[Row] = []
        self.cache: list = []
        self.cost = VerifyCost()
        self.proposals = Proposals(recycled)
        self.counts = {"steps": 0, "speculative_steps": 0, "row_steps": 0, "proposed": 0, "accepted": 0,
                       "committed": 0}
        self.widths: dict[int, int] = {}
        self._uid = 0
        self._holed = 0  # steps that left holes

    def __len__(self) -> int:
        return len(self.rows)

    def insert(self, tokens: list[int], held: int, cache: Optional[list], opts: DecodeOptions, left: int) -> int:
        """A request joins at the next step: `tokens` committed so far, `cache` holding tokens[:held] (or None)."""
        base, processors = samplers(opts)
        lookup = Lookup(tokens, opts.ngram_max, opts.ngram_min or NGRAM_MIN, row_cost=0)
        row = Row(self._uid, list(tokens), left, row_sampler(base, opts.seed), processors,
                  base is greedy_sampler and not processors, frozenset(opts.stop_tokens), lookup,
                  cache if cache is not None else trimmable_cache(self.model), held if cache is not None else 0)
        self._uid += 1
        self.joining.append(row)
        return row.uid

    def next(self) -> tuple[bool, list[Out]]:
        """One step: rows waiting to join are prefilled (up to prompt_concurrency together), then every row
        verifies its window. (Whether a prompt was prefilled, what each row committed.)"""
        prefilled = self._join()
        return prefilled, (self._step() if self.rows else [])

    def remove(self, uids: Sequence[int], return_prompt_caches: bool = False) -> dict:
        """Rows leave; with return_prompt_caches, uid → (its cache, the tokens it holds), as BatchGenerator's."""
        out = {}
        for row in [r for r in self.joining if r.uid in uids]:
            self.joining.remove(row)
            out[row.uid] = (row.cache, row.tokens[: row.held])
        gone = [i for i, r in enumerate(self.rows) if r.uid in uids]
        if return_prompt_caches:
            for i in gone:
                out[self.rows[i].uid] = ([c.extract(i) for c in self.cache], self.rows[i].tokens[:-1])
        if gone:
            self._keep([i for i in range(len(self.rows)) if i not in gone])
        return out if return_prompt_caches else {}

    @property
    def prompt_cache_nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache) + sum(c.nbytes for r in self.joining for c in r.own_cache)

    def close(self) -> None:
        self.rows, self.joining, self.cache = [], [], []

    def health(self) -> dict:
        """Its counts for /health (read from a handler's thread: each dict copied at once, under the GIL), those
        each proposer offered and had accepted among them; `recycle`: whether rows propose recycled chains."""
        c = dict(self.counts, **self.proposals.counts)
        return dict(c, recycle=self.proposals.table is not None,
                    accepted_per_row_step=round(c["accepted"] / c["row_steps"], 3) if c["row_steps"] else 0.0,
                    widths={str(w): n for w, n in sorted(dict(self.widths).items())}, step_ms=self.cost.as_dict())

    # --- a step

    def _join(self) -> bool:
        if not self.joining:
            return False

        group, self.joining = self.joining[: self.prompt_concurrency], self.joining[self.prompt_concurrency:]
        ready = [r for r in group if r.held == len(r.tokens) - 1]  # (a request that decoded alone: nothing to run)
        prefilled = [r for r in group if r.held < len(r.tokens) - 1]
        for part in (ready, prefilled):
            if not part:
                continue
            batch = PromptProcessingBatch(self.model, [r.uid for r in part], [r.own_cache for r in part],
                                          [r.tokens[: r.held] for r in part], prefill_step_size=self.prefill_step_size)
            if part is prefilled:  # right-padded, then rolled into left padding (mlx-lm's own prefill)
                batch.prompt([r.tokens[r.held : -1] for r in part])
            for r in part:
                r.cache = None
            if self.rows:
                for mine, theirs in zip(self.cache, batch.prompt_cache):
                    mine.extend(theirs)
            else:
                self.cache = [HoleKVCache.adopt(c) for c in batch.prompt_cache]
            self.rows += part
        return bool(prefilled)

    def _step(self) -> list[Out]:
        rows = self.rows
        offers = self.proposals.offers([(r.lookup, r.tokens[-1], min(self.gamma, r.left - 1)) for r in rows])
        widest = 1 + max(len(o.window) for o in offers)
        width = choose_width([o.survival for o in offers], lambda w: self.cost.seconds(len(rows), w), widest)
        windows = [o.window[: width - 1] for o in offers]
        width = 1 + max(len(w) for w in windows)
        runs = [[r.tokens[-1]] + w for r, w in zip(rows, windows)]  # each row's pending token, then its window
        x = mx.array([run + [0] * (width - len(run)) for run in runs])
        t = time.perf_counter()
        logits = self.model(x, cache=self.cache)
        chosen = self._choose(rows, windows, logits)
        top = self.proposals.top(logits)
        self.cost.note(len(rows), width, time.perf_counter() - t)
        outs, drops, walked = [], [], []
        for r, w, o, (ys, lp) in zip(rows, windows, offers, chosen):
            a = accept(w, ys)
            walked.append(a)
            new = w[:a] + [ys[a]]
            stop = next((k for k, y in enumerate(new) if y in r.stops), None)
            new = new[: r.left if stop is None else min(r.left, stop + 1)]
            finish = "stop" if new[-1] in r.stops else "length" if len(new) >= r.left else None
            r.tokens += new
            r.left -= len(new)
            r.lookup.extend(new)
            drops.append(width - len(new))
            outs.append(Out(r.uid, new, [j < a for j in range(len(new))], [lp[j] for j in range(len(new))], finish))
            self.counts["proposed"] += len(w)
            self.counts["accepted"] += min(a, len(new))
            self.counts["committed"] += len(new)
            self.proposals.settle(o, len(w), min(a, len(new)))
        self.proposals.learn(runs, [ys for ys, _ in chosen], walked, top)
        self._drop(drops)
        self.counts["steps"] += 1
        self.counts["row_steps"] += len(rows)
        self.counts["speculative_steps"] += width > 1
        self.widths[width] = self.widths.get(width, 0) + 1
        done = [i for i, o in enumerate(outs) if o.finish is not None]
        for i in done:
            outs[i].cache, outs[i].all_tokens = [c.extract(i) for c in self.cache], rows[i].tokens[:-1]
        if done:
            self._keep([i for i in range(len(rows)) if i not in done])
        return outs

    def _choose(self, rows: list[Row], windows: list[list[int]], logits: mx.array) -> list[tuple[list[int], Any]]:
        """Each row's token at each of its positions and their log-probabilities, as mlx-lm's loop would choose
        them: greedy rows by the batch's argmax of the log-probabilities, the others by their own sampler and
        processors (sampling.sample_rows: row j sees the row's tokens + window[:j], its draw keyed by position)."""
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked: list = []
        for i, (r, w) in enumerate(zip(rows, windows)):
            if r.greedy:
                picked.append((None, logprobs[i, : len(w) + 1]))
            else:
                picked.append(sample_rows(logits[i, : len(w) + 1], r.tokens, w, r.sample, r.processors))
        if any(r.greedy for r in rows):
            top = int_rows(mx.argmax(logprobs, axis=-1))
            picked = [(top[i][: len(w) + 1] if ys is None else ys, lp)
                      for i, ((ys, lp), w) in enumerate(zip(picked, windows))]
        return picked

    def _drop(self, drops: list[int]) -> None:
        """Row i's cache drops its last drops[i] positions: the fewest any row drops come off the shared end, the
        rest of each row's become holes; every COMPACT steps that dropped some, the holes are squeezed out if
        they waste more than COMPACT positions a row."""
        least = min(drops)
        rest = [d - least for d in drops]
        for c in self.cache:
            if least:
                c.trim(least)
            if any(rest):
                c.drop(rest)
        if any(rest):
            self._holed += 1
            if self._holed % COMPACT == 0 and self.cache[0].waste() > COMPACT:
                for c in self.cache:
                    c.compact()

    def _keep(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = []
            return
        for c in self.cache:
            c.filter(keep)
