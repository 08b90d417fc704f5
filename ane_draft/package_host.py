"""The host half of a Core ML draft: chunking, tree masks, positions and the rollout loop.

Pure numpy and platform-free, so the very same code drives the package on a Mac (through Core ML)
and on Linux (through the MIL evaluator, convert/mil_eval.py). A `runner` has
`call(fn, inputs) -> outputs` and `reset()`; fn is 'extend' or 'rollout' (see convert/coreml.py
for the static shapes).

Rollback is free: slots past the committed prefix are masked, never erased. The rollout puts the
stems into a trie (stems share accepted draft tokens), then fills each call's B rows with trie
nodes first and then one new token per branch, so J = ceil(trie / B) + gamma - 1 calls; branch
rows live in the scratch slots for the duration of one rollout.
"""

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import numpy as np

from convert.coreml import NEG, Shapes, package_shapes
from mirror_mlx.draft_api import Rollout


class Runner(Protocol):
    def call(self, fn: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def reset(self) -> None: ...


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class _Node:
    token: int
    parent: int  # -1: the committed context
    depth: int  # 0 for the first token after the context
    slot: int = -1  # scratch slot once written
    call: int = -1


@dataclass
class Trace:
    """Logits the package produced, kept for parity checks: extend rows by position, and for
    every branch the logit rows that chose its window tokens."""

    extend: dict[int, np.ndarray] = field(default_factory=dict)
    windows: list[np.ndarray] = field(default_factory=list)
    calls: int = 0


class PackageDraft:
    """The Draft protocol over a package's `extend` and `rollout` functions."""

    def __init__(self, runner: Runner, meta: dict[str, str], trace: bool = False):
        self.runner = runner
        self.shapes: Shapes = package_shapes(meta)
        self.vocab_size = int(meta["vocab"])
        self.n_logits = int(meta["logit_outputs"])
        self.keep_trace = trace
        self.trace = Trace()
        self.reset()

    def reset(self) -> None:
        self.runner.reset()
        self.cached: list[int] = []

    # ------------------------------------------------------------------ calls

    def _logits(self, out: dict[str, np.ndarray]) -> np.ndarray:
        if self.n_logits == 1:
            return out["logits"][0]
        return np.concatenate([out[f"logits_{j}"][0] for j in range(self.n_logits)], axis=-1)

    def _call(self, fn: str, ids: np.ndarray, pos: np.ndarray, write_pos: int, mask: np.ndarray) -> np.ndarray:
        out = self.runner.call(fn, {
            "input_ids": ids.astype(np.int32)[None, :],
            "positions": pos.astype(np.int32),
            "write_pos": np.array([write_pos], np.int32),
            "mask": mask.astype(np.float16)[None],
        })
        return self._logits(out)

    # ------------------------------------------------------------------ committed prefix

    def sync(self, context: Sequence[int]) -> None:
        """Make the cache hold exactly `context`: keep the common prefix, extend with the rest."""
        S, E = self.shapes.context, self.shapes.chunk
        n = len(context)
        if n > S:
            raise ValueError(
                f"the context has {n} tokens but this Core ML draft was built for {S}; "
                f"rebuild it with `mirror-mlx convert --context {max(n, 2 * S)}` or shorten the prompt"
            )
        keep = common_prefix(self.cached, context)
        while keep < n:
            start = keep if keep + E <= n else max(0, n - E)  # end-aligned: re-writes equal rows
            chunk = list(context[start : start + E])
            real = len(chunk)
            ids = np.array(chunk + [0] * (E - real))
            pos = start + np.arange(E)
            mask = np.full((S + E, E), NEG, np.float32)
            mask[:start, :] = 0.0
            mask[S:, :] = np.where(np.arange(E)[:, None] <= np.arange(E)[None, :], 0.0, NEG)
            logits = self._call("extend", ids, pos, start, mask)
            if self.keep_trace:
                for i in range(real):
                    self.trace.extend[start + i] = logits[i].copy()
            keep = start + real
        self.cached = list(context)

    # ------------------------------------------------------------------ branch rollout

    def _trie(self, stems: Sequence[Sequence[int]]) -> tuple[list[_Node], list[int]]:
        nodes: list[_Node] = []
        index: dict[tuple[int, int], int] = {}
        leaves = []
        for stem in stems:
            parent = -1
            for d, t in enumerate(stem):
                key = (parent, int(t))
                if key not in index:
                    index[key] = len(nodes)
                    nodes.append(_Node(int(t), parent, d))
                parent = index[key]
            leaves.append(parent)
        return nodes, leaves

    def rollout(self, context: Sequence[int], stems: Sequence[Sequence[int]], gamma: int) -> Rollout:
        if not stems or any(len(s) == 0 for s in stems):
            raise ValueError("rollout needs at least one stem and every stem must be non-empty")
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1 (got {gamma})")
        self.sync(context)
        if self.keep_trace:
            self.trace.windows, self.trace.calls = [], 0
        windows, calls = self._rollout_groups(len(context), [list(map(int, s)) for s in stems], gamma)
        return Rollout(windows=windows, forwards=calls, tokens=gamma)

    def _rollout_groups(self, n_ctx: int, stems: list[list[int]], gamma: int) -> tuple[list[list[int]], int]:
        """Split the stems when one batched rollout would not fit the scratch slots."""
        nodes, leaves = self._trie(stems)
        max_calls = self.shapes.scratch // self.shapes.rows
        if len(stems) == 1 or self._rollout_once(n_ctx, nodes, leaves, gamma, dry=True)[1] <= max_calls:
            return self._rollout_once(n_ctx, nodes, leaves, gamma)
        half = len(stems) // 2
        w1, c1 = self._rollout_groups(n_ctx, stems[:half], gamma)
        w2, c2 = self._rollout_groups(n_ctx, stems[half:], gamma)
        return w1 + w2, c1 + c2

    def _rollout_once(self, n_ctx: int, nodes: list[_Node], leaves: list[int], gamma: int, dry: bool = False):
        """One batched rollout; with dry=True only count the calls it would take."""
        S, B, W = self.shapes.context, self.shapes.rows, self.shapes.scratch
        K = S + W
        nodes = [_Node(n.token, n.parent, n.depth) for n in nodes]
        top = max(n.depth for n in nodes) + gamma
        if n_ctx + top > K and not dry:
            raise ValueError(
                f"context ({n_ctx}) + stem + gamma ({top}) exceeds the package's {K} positions; "
                "rebuild it with a larger --context"
            )
        branches = list(dict.fromkeys(leaves))  # unique leaves, first-seen order
        last = {b: b for b in branches}  # branch -> node whose logits choose its next token
        out: dict[int, list[int]] = {b: [] for b in branches}
        rows_of: dict[int, list[np.ndarray]] = {b: [] for b in branches}
        trie_left = list(range(len(nodes)))
        feed: list[int] = []  # generated nodes waiting for a row
        calls = 0
        while any(len(out[b]) < gamma for b in branches):
            if (calls + 1) * B > W and not dry:
                raise ValueError("rollout does not fit the package's scratch slots; use fewer or shorter stems")
            batch = trie_left[:B]
            trie_left = trie_left[len(batch):]
            fed = feed[: B - len(batch)]
            feed = feed[len(fed):]
            batch += fed
            row_of = {u: r for r, u in enumerate(batch)}
            write = S + calls * B
            logits = None if dry else self._rollout_call(n_ctx, nodes, batch, row_of, write)
            for r, u in enumerate(batch):
                nodes[u].slot = write + r
            for b in branches:
                u = last[b]
                if u not in row_of or len(out[b]) == gamma:
                    continue
                tok = 0 if dry else int(np.argmax(logits[row_of[u]]))
                out[b].append(tok)
                if self.keep_trace and not dry:
                    rows_of[b].append(logits[row_of[u]].copy())
                if len(out[b]) < gamma:
                    nodes.append(_Node(tok, u, nodes[u].depth + 1))
                    last[b] = len(nodes) - 1
                    feed.append(last[b])
            calls += 1
        if self.keep_trace and not dry:
            self.trace.windows += [np.stack(rows_of[b]) for b in leaves]
            self.trace.calls += calls
        return [list(out[b]) for b in leaves], calls

    def _rollout_call(self, n_ctx: int, nodes: list[_Node], batch: list[int], row_of: dict[int, int],
                      write: int) -> np.ndarray:
        """One `rollout` call: each row sees the context, its ancestors (earlier calls' scratch
        slots or this call's rows) and itself."""
        S, B, W = self.shapes.context, self.shapes.rows, self.shapes.scratch
        K = S + W
        ids = np.zeros(B, np.int64)
        pos = np.zeros(B, np.int64)
        mask = np.full((K + B, B), NEG, np.float32)
        mask[:n_ctx, : len(batch)] = 0.0
        for r, u in enumerate(batch):
            ids[r], pos[r] = nodes[u].token, n_ctx + nodes[u].depth
            a = u
            while a != -1:
                mask[K + row_of[a] if a in row_of else nodes[a].slot, r] = 0.0
                a = nodes[a].parent
        for r in range(len(batch), B):
            mask[K + r, r] = 0.0  # padding rows see themselves only
        return self._call("rollout", ids, pos, write, mask)
