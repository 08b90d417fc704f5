"""What each row of the server's batch proposes (server/spec_batch.py): its prompt lookup's window over its own
context, or, with the recycled draft (`--draft-model recycle`), the recycled chain: the rank-0 successors of the
row's pending token in the table of the target's top candidates after each token (proposers/recycle.py), the
first path the engine's recycled tree would grow. A chain is a plain window, so it fits the batch's right-padded
windows (a tree per row would not). Each proposal comes with its expected survival at its own proposer's
acceptance so far (the row's lookup record; the table's p(depth, rank 0)); a row takes the one that expects more
accepted tokens. The table is the engine's, shared by every row and by the solo generations: every batched
verify teaches it as the engine's tree verify does (each walked position counted against its candidates, each
verified position's token given the target's top-K after it there).
"""

from dataclasses import dataclass, field
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..engine.target import top_ids
from ..proposers.lookup import LOOKUP, Lookup
from ..proposers.recycle import BUCKETS, K, RECYCLE, Recycled


@dataclass
class Offer:
    """One row's proposal: its tokens, P(its first i are right) for i = 1..len, and which proposer made it."""

    window: list[int] = field(default_factory=list)
    survival: list[float] = field(default_factory=list)
    source: str = ""  # LOOKUP or RECYCLE ("": none)


def chain(table: Recycled, pending: int, n: int) -> Offer:
    """The rank-0 successors of `pending` in the table, up to n (ending where the table has none), each one's
    survival the product of p(d, 0) down to its depth."""
    p0 = table.p()[:, 0]
    window, survival, t, s = [], [], pending, 1.0
    for d in range(n):
        t = int(table.table[t, 0])
        if t < 0:
            break
        s *= float(p0[min(d, BUCKETS - 1)])
        window.append(t)
        survival.append(s)
    return Offer(window, survival, RECYCLE if window else "")


class Proposals:
    """The batch's proposers: each row's own lookup, and the recycled table (None: the lookup alone). `counts`:
    the tokens each proposer offered to a verify and had accepted."""

    def __init__(self, table: Optional[Recycled] = None):
        self.table = table
        self.counts = {f"{s}_{c}": 0 for s in (LOOKUP, "recycled") for c in ("proposed", "accepted")}

    def offers(self, rows: Sequence[tuple[Lookup, int, int]]) -> list[Offer]:
        """Each row's proposal of at most n tokens after its pending token, for (lookup, pending, n) each: the
        lookup's, or the chain where that expects more accepted tokens (sum of survivals)."""
        out = []
        for lookup, pending, n in rows:
            window, survival = lookup.offer(n) if n > 0 else ([], [])
            mine = Offer(window, survival, LOOKUP if window else "")
            if self.table is not None and n > 0:
                other = chain(self.table, pending, n)
                mine = other if sum(other.survival) > sum(mine.survival) else mine
            out.append(mine)
        return out

    def top(self, logits: mx.array) -> Optional[np.ndarray]:
        """(rows, width, K): the target's top ids at every position of the verify, where the table learns."""
        if self.table is None:
            return None
        rows, width, vocab = logits.shape
        return np.array(top_ids(logits.reshape(rows * width, vocab), K)).reshape(rows, width, K)

    def settle(self, offer: Offer, verified: int, accepted: int) -> None:
        """A row's verify: of its offer, `verified` tokens ran (the chosen width's) and `accepted` were kept."""
        if offer.source:
            key = LOOKUP if offer.source == LOOKUP else "recycled"
            self.counts[f"{key}_proposed"] += verified
            self.counts[f"{key}_accepted"] += accepted

    def learn(self, runs: Sequence[Sequence[int]], chosen: Sequence[Sequence[int]], walked: Sequence[int],
              top: Optional[np.ndarray]) -> None:
        """After a verify, for each row: `runs`, the tokens it ran (pending + window), `chosen`, the target's token
        at each, `walked`, its accepted count. Every walked position (the pending one and the accepted) is counted
        against its candidates as they were before this verify, then every run token's row becomes the target's
        top-K after it."""
        if self.table is None or top is None:
            return
        table = self.table
        before = [table.table[np.asarray(run)].tolist() for run in runs]
        for options, ys, a in zip(before, chosen, walked):
            for depth in range(a + 1):
                table.count(options[depth], depth, int(ys[depth]))
        for run, t in zip(runs, top):
            table.table[np.asarray(run)] = t[: len(run)]
