"""A token tree verified in one target forward, through mlx-lm's own model objects.

A tree holds the pending token (node 0, the root) and proposed continuations in breadth-first order. One
forward over all nodes gives the target's distribution after every path: node i attends to the cache and its
own ancestors only, at position offset + depth(i). No per-architecture code: the mask comes from each cache's
own `make_mask` (with the layer's sliding window), the positions from each attention's own rope module (each
row a sequence of one at its own position, so every rope variant places a node as it would a token). A model
that does not fit (a recurrent state, another cache kind, an attention with no `rope`) is refused by
`takes_tree`, and only a chain (a plain window) is verified.

`walk` commits, at each node, the target's own token there given the committed prefix and the path, and
descends while a child holds it. The drafts proposing a tree are deterministic, so each committed token is
a sample of the target's distribution given what precedes it, whatever the tree held.
"""

from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from .sampling import sample_rows


@dataclass
class Tree:
    """Node 0 is the pending token; parents[i] < i; depths never decrease along the list."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    sources: list[str] = field(default_factory=list)  # who proposed each node ("" for the root)
    options: list[Optional[list[int]]] = field(default_factory=list)  # a node's candidate children when grown

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """Every node's parent is the one before it: a plain window, verified by a causal forward."""
        return all(p == i - 1 for i, p in enumerate(self.parents) if i)

    def child(self, node: int, token: int) -> Optional[int]:
        """The child of `node` holding `token`, or None."""
        return next((i for i in range(node + 1, len(self.tokens)) if self.parents[i] == node
                     and self.tokens[i] == token), None)

    def mask(self) -> np.ndarray:
        """(n, n) bool: node i sees node j iff j is i or one of its ancestors."""
        n = len(self.tokens)
        seen = np.zeros((n, n), dtype=bool)
        for i in range(n):
            if i:
                seen[i] = seen[self.parents[i]]
            seen[i, i] = True
        return seen


def chain(pending: int, window: list[int], source: str = "") -> Tree:
    """A plain window as a tree."""
    n = len(window) + 1
    return Tree([pending] + list(window), list(range(-1, n - 1)), list(range(n)), [""] + [source] * len(window),
                [None] * n)


def build(pending: int, nodes: list[tuple[int, int, str, Optional[list[int]]]]) -> Tree:
    """A tree from (parent, token, source, options) entries, parents given as indices into `nodes` + 1 (0 is the
    root), in any order as long as a parent comes before its children: put in breadth-first order."""
    depth = [0]
    for parent, *_ in nodes:
        depth.append(depth[parent] + 1)
    order = [0] + sorted(range(1, len(nodes) + 1), key=lambda i: depth[i])  # stable: ties keep their order
    where = {old: new for new, old in enumerate(order)}
    entries = [(-1, pending, "", None)] + nodes
    return Tree([entries[i][1] for i in order], [where[entries[i][0]] if i else -1 for i in order],
                [depth[i] for i in order], [entries[i][2] for i in order], [entries[i][3] for i in order])


def _ropes(model: nn.Module) -> list[nn.Module]:
    """Every attention's rope module, found once per model (a verify step does not walk the module tree)."""
    ropes = getattr(model, "_tree_ropes", None)
    if ropes is None:
        ropes = [m.rope for _, m in model.named_modules() if isinstance(getattr(m, "rope", None), nn.Module)]
        object.__setattr__(model, "_tree_ropes", ropes)  # a plain attribute, not one of the module's children
    return ropes


def takes_tree(model: nn.Module, cache: list[Any]) -> Optional[str]:
    """None if a tree can be verified in one forward of this model over this cache; else why not (one clause)."""
    if any(type(c) is not KVCache for c in cache):
        kinds = sorted({type(c).__name__ for c in cache if type(c) is not KVCache})
        return f"its {', '.join(kinds)} layers hold one path only"
    if len(_ropes(model)) != len(cache):
        return "its attention layers do not each place tokens with a rope module"
    return None


def _mask_for(offset: int, ancestors: mx.array, depths: mx.array):
    def make_mask(n, return_array=False, window_size=None, **_):
        seen = mx.concatenate([mx.ones((n, offset), dtype=mx.bool_), ancestors], axis=1)
        if window_size is not None:  # key k is seen by query q only within the window of q's position
            q = offset + depths[:, None]
            k = mx.concatenate([mx.arange(offset), offset + depths])[None, :]
            seen = seen & (q - k < window_size)
        return seen

    return make_mask


@contextmanager
def _tree_forward(model: nn.Module, cache: list[Any], tree: Tree) -> Iterator[None]:
    """While active: each cache's mask is the tree's (with the layer's sliding window), each rope places the
    rows of depth d at offset + d. Undone on exit, so the model and caches are as they were."""
    ropes, groups, start = _ropes(model), [], 0
    for i in range(1, len(tree) + 1):
        if i == len(tree) or tree.depths[i] != tree.depths[start]:
            groups.append((tree.depths[start], start, i))
            start = i
    ancestors, depths = mx.array(tree.mask()), mx.array(tree.depths)
    for c in cache:
        c.make_mask = _mask_for(c.offset, ancestors, depths)
    for rope in ropes:
        cls = type(rope)

        def __call__(self_, x, offset=0, _cls=cls):
            if x.shape[0] == 1:  # each row a sequence of one, in the batch, at its own position: one call
                with suppress(TypeError, ValueError):  # a rope that takes no positions array: a call per depth
                    return _cls.__call__(self_, x.swapaxes(0, 2), offset=offset + depths).swapaxes(0, 2)
            return mx.concatenate([_cls.__call__(self_, x[..., s:e, None, :], offset=offset + d)[..., 0, :]
                                   for d, s, e in groups], axis=-2)

        rope.__class__ = type("Tree" + cls.__name__, (cls,), {"__call__": __call__})
    try:
        yield
    finally:
        for c in cache:
            c.__dict__.pop("make_mask", None)
        for rope in ropes:
            rope.__class__ = type(rope).__mro__[1]


def forward(model: nn.Module, cache: list[Any], tree: Tree) -> mx.array:
    """The target's logits (n, V) after every node; the cache then holds every node's keys and values."""
    tokens = mx.array([tree.tokens])
    if tree.is_chain:
        return model(tokens, cache=cache)[0]
    with _tree_forward(model, cache, tree):
        return model(tokens, cache=cache)[0]


def keep_path(cache: list[Any], before: int, kept: list[int]) -> None:
    """After a forward over the tree from offset `before`, keep only the rows of `kept` (node indices, the root
    first, then the accepted path) in that order: the cache then holds the committed tokens only."""
    n = len(kept)
    if kept == list(range(n)):  # a path along the node order (a chain's prefix): drop the rest
        for c in cache:
            c.trim(c.offset - before - n)
        return
    rows = mx.array([before + i for i in kept])
    for c in cache:
        c.keys[..., before:before + n, :] = c.keys[..., rows, :]
        c.values[..., before:before + n, :] = c.values[..., rows, :]
        c.offset = before + n


@dataclass
class Walk:
    """What a tree's verify committed: the accepted nodes, then the target's own token after the last."""

    path: list[int]  # accepted node indices (the root excluded)
    tokens: list[int]  # the accepted nodes' tokens, then the target's own
    logprobs: mx.array  # the walked rows' log-probabilities (as sample_rows gives them), one per committed token


def walk(logits: mx.array, tree: Tree, history: list[int], sampler, processors) -> Walk:
    """From the root, the target's token at each node (given the committed prefix and the path): descend to the
    child that holds it, until none does. Only the walked rows are sampled, each at its absolute position."""
    node, path, tokens, rows = 0, list[int](), list[int](), []
    while True:
        ys, logprobs = sample_rows(logits[node:node + 1], list(history) + tokens, [], sampler, processors)
        rows.append(logprobs)
        nxt = tree.child(node, ys[0])
        tokens.append(ys[0])
        if nxt is None:
            return Walk(path, tokens, mx.concatenate(rows, axis=0))
        path.append(nxt)
        node = nxt
