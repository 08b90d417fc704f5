"""Recycled predictions (Token Recycling, arXiv 2408.08696): a draft with no draft model.

Every verify computes the target's distribution after every row it ran, and all but the committed rows' are
thrown away. Kept instead, for each token t, the target's top-K after t (the last time t was a verify row)
form an adjacency table (vocab × K ids: 49k × 8 int32 is 1.5 MB). A tree grown from it (the pending token's
candidates, theirs, ...) is verified in one forward (tree.py), which commits the longest path it agrees with.

The tree's shape is chosen by measured cost, as the lookup's window is: a verify of n + 1 rows costs about
1 + row_cost · n one-row forwards, and a node reached through ranks r1..rd is accepted with probability
p(1, r1) ⋯ p(d, rd), p(d, r) being how often the target's token at depth d was the node's rank-r candidate
(priors until walks count it). The shape is the n most probable nodes, n the count with the most tokens per
unit of time (none where no n beats a one-row forward by MARGIN). The table lives as long as the pipeline,
and a prefill's rows fill it too (SmolLM2-135M over Spec-Bench: 1.56 tokens per forward against 1.33 without).
"""

import heapq
from typing import Callable, Optional, Sequence

import numpy as np

from .lookup import MARGIN, ROW_COST
from ..engine.tree import Tree, build, chain

RECYCLE = "recycle"  # the draft model's name that means the recycled predictions (load(draft_model="recycle"))
K = 8  # candidates kept per token
DEPTH = 10  # deepest node grown
# most nodes grown (rows free: SmolLM2-135M 2.39 tokens a forward, 64 nodes 2.21; docs/bench/recycle-sizes.md)
NODES = 128
BUCKETS = 4  # p(d, r) is kept per depth 1, 2, 3 and 4 or more
PRIOR = (0.3, 0.12, 0.07, 0.05, 0.04, 0.03, 0.02, 0.02)  # p(d, r) before any walk, by rank
PRIOR_WEIGHT = 4.0
WIDTHS = (1, 2, 4, 8, 16, 32)  # verify widths (rows) the engine times once per pipeline (in its first prefill)


def verify_cost(row_cost: Optional[float], widths: Optional[dict[int, float]]) -> Callable[[int], float]:
    """The cost of verifying n nodes (n + 1 rows) in one-row forwards: 1 + row_cost · n where given; else the
    timed widths interpolated, past the widest by its last slope (rows are near free up to some width, then
    linear: no one slope fits both); else 1 + ROW_COST · n."""
    if row_cost is not None or not widths:
        c = ROW_COST if row_cost is None else row_cost
        return lambda n: 1.0 + c * n
    rows = sorted(widths)
    cost = [widths[r] / widths[rows[0]] for r in rows]

    def at(n: int) -> float:
        r = n + 1
        i = next((j for j in range(1, len(rows)) if rows[j] >= r), len(rows) - 1)
        slope = (cost[i] - cost[i - 1]) / (rows[i] - rows[i - 1])
        return max(1.0, cost[i - 1] + slope * (r - rows[i - 1]))

    return at


class Recycled:
    """The adjacency table and the acceptance by (depth, rank) that sizes the tree. `one_path`: the target
    takes no tree (tree.takes_tree's reason), so only rank-0 chains are grown."""

    def __init__(self, vocab_size: int, one_path: Optional[str] = None):
        self.table = np.full((vocab_size, K), -1, dtype=np.int32)
        self.one_path = one_path
        self.reached = np.zeros(BUCKETS, dtype=np.int64)  # walks that visited a node of this depth bucket
        self.right = np.zeros((BUCKETS, K), dtype=np.int64)  # of them, the target's token was rank r
        self.widths: Optional[dict[int, float]] = None  # the target's verify seconds by rows (WIDTHS), once timed

    def p(self) -> np.ndarray:
        """(BUCKETS, K): the chance that a node's rank-r candidate is the target's token there."""
        prior = np.array(PRIOR[:K], dtype=np.float64)
        return (self.right + PRIOR_WEIGHT * prior) / (self.reached[:, None] + PRIOR_WEIGHT)

    def shape(self, depth: int, cost: Callable[[int], float]) -> list[tuple[int, int]]:
        """The tree that pays, as (parent slot + 1, rank) slots in the order of their probability (slot 0 the
        root), at most `depth` deep; [] when none pays."""
        p, width = self.p(), 1 if self.one_path else K
        heap = [(-p[0, r], 0, r, 1) for r in range(width)]  # (-probability, parent, rank, depth)
        heapq.heapify(heap)
        slots, expected, best, rate = list[tuple[int, int]](), 1.0, 0, MARGIN
        while heap and len(slots) < NODES:
            q, parent, rank, d = heapq.heappop(heap)
            if d > depth:
                continue
            slots.append((parent, rank))
            expected -= q
            if expected / cost(len(slots)) > rate:
                best, rate = len(slots), expected / cost(len(slots))
            for r in range(width):
                heapq.heappush(heap, (q * p[min(d, BUCKETS - 1), r], len(slots), r, d + 1))
        return slots[:best]

    def grow(self, pending: int, lookup: Sequence[int], depth: int, row_cost: Optional[float]) -> Tree:
        """The tree to verify after `pending`: the lookup's proposal as its first branch (nodes it shares with the
        recycled ones count as the lookup's), then the recycled slots that pay and that the table fills."""
        nodes: list[tuple[int, int, str, Optional[list[int]]]] = []
        if self.one_path:  # one chain: the lookup's where it offers one, else the rank-0 one
            if lookup:
                return chain(pending, list(lookup[:depth]), "lookup")
            slots = self.shape(depth, verify_cost(row_cost, self.widths))
            window, t = [], pending
            for _ in slots:
                t = int(self.table[t, 0])
                if t < 0:
                    break
                window.append(t)
            return chain(pending, window, RECYCLE)
        token = {0: pending}
        children: dict[tuple[int, int], int] = {}
        for t in lookup[:depth]:
            parent = len(nodes) if nodes else 0
            nodes.append((parent, int(t), "lookup", None))
            token[len(nodes)] = int(t)
            children[(parent, int(t))] = len(nodes)
        where = {0: 0}  # slot -> node (0 the root); a slot whose parent has no node, or an empty entry, is skipped
        for s, (parent, rank) in enumerate(self.shape(depth, verify_cost(row_cost, self.widths)), start=1):
            if parent not in where:
                continue
            node = where[parent]
            t = int(self.table[token[node], rank])
            if t < 0:
                continue
            if (node, t) in children:  # the lookup's branch holds it already
                where[s] = children[(node, t)]
                continue
            nodes.append((node, t, RECYCLE, None))
            token[len(nodes)] = t
            children[(node, t)] = where[s] = len(nodes)
        tree = build(pending, nodes)
        tree.options = [self.table[t].tolist() for t in tree.tokens]
        return tree

    def learn_prefill(self, tokens: Sequence[int], top: np.ndarray) -> None:
        """A prefill's rows: each token's row of the table becomes the target's top-K after it there."""
        if len(tokens):
            self.table[np.asarray(tokens)] = top[:, :K]

    def learn(self, tree: Tree, path: list[int], tokens: list[int], top: np.ndarray) -> None:
        """After a verify: count, at every walked node, which rank of its candidates (as grown) the target's
        token was; then each node's row of the table becomes the target's top-K after it (`top`, (n, K))."""
        for node, y in zip([0] + path, tokens):
            self.count(tree.options[node] if tree.options else None, tree.depths[node], y)
        self.table[np.asarray(tree.tokens)] = top[:, :K]

    def count(self, options: Optional[Sequence[int]], depth: int, y: int) -> None:
        """A walked node's candidates (as they were when grown), `depth` deep, against the target's token there:
        one more visit of its depth's bucket, and a right one at the rank y had (none if y was not among them)."""
        if options is None or options[0] < 0:
            return
        b = min(depth, BUCKETS - 1)
        self.reached[b] += 1
        if y in options:
            self.right[b, list(options).index(y)] += 1
