"""The host half of a Core ML draft: chunking, tree masks, positions and the rollout loop.

Pure numpy, so the same code drives the package on a Mac (Core ML, in the draft host) and on Linux
(the MIL evaluator, convert/mil_eval.py). A `runner` has `call(fn, inputs) -> outputs` and
`reset()`; fn is 'extend' or 'rollout' (static shapes: convert/coreml.py).

Rollback is free: slots past the committed prefix are masked, never erased. The rollout puts the
stems into a trie and fills each call's B rows with trie nodes first, then with each unfinished
branch's next rows; every row sees the context, its ancestors (scratch slots of earlier calls or
rows of this call) and itself. A plain draft feeds one row per branch per call; a
Speculative-Streaming draft feeds a chain per branch, its pending main token and its stream
guesses, and keeps the prefix its main rows agree with (SS self-verification, as in
mirror_mlx/drafts/ss/draft.py): the same greedy windows in fewer calls.

A distilled draft's package scores only its kept ids (V columns per row, metadata `kept_ids`): every argmax
goes through them (`token`), so the engine sees real token ids, as from the MLX distilled draft. No logit
row leaves the host but in the parity trace, which keeps the package's V columns.
"""

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import numpy as np

from mirror_mlx.ane_draft.package_format import NEG, Shapes, package_shapes, read_kept_ids
from mirror_mlx.drafts.mlx_draft import check_stems, self_verify
from mirror_mlx.engine.model_parts import common_prefix
from mirror_mlx.drafts.api import Rollout


@dataclass
class _Node:
    token: int
    parent: int  # -1: the committed context
    depth: int  # 0 for the first token after the context
    slot: int = -1  # scratch slot once written


@dataclass
class _Branch:
    last: int  # node whose logits give the next tokens
    window: list[int] = field(default_factory=list)
    chain: list[int] = field(default_factory=list)  # nodes to feed next: main token, then guesses


@dataclass
class Trace:
    """What the package produced, kept for parity checks: extend logits by position, and every
    rollout row as (tokens after the context, main logits, stream logits (streams, V) or None)."""

    extend: dict[int, np.ndarray] = field(default_factory=dict)
    rows: list[tuple[tuple[int, ...], np.ndarray, Optional[np.ndarray]]] = field(default_factory=list)


class Runner(Protocol):
    """A package's functions run by name: Core ML's (coreml_draft.CoreMLRunner) or the MIL evaluator's."""

    def reset(self) -> None: ...

    def call(self, fn: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class PackageDraft:
    """The Draft protocol over a package's `extend` and `rollout` functions."""

    def __init__(self, runner: Runner, meta: dict[str, str], trace: bool = False):
        self.runner = runner
        self.shapes: Shapes = package_shapes(meta)
        self.vocab_size = int(meta["vocab"])  # token ids the engine may see (a distilled head scores fewer)
        self.kept = read_kept_ids(meta)  # column j of a logit row scores token kept[j]; None: column j is id j
        self.n_logits = int(meta["logit_outputs"])
        self.keep_trace = trace
        self.trace = Trace()
        self.reset()

    def reset(self) -> None:
        self.runner.reset()
        self.cached: list[int] = []

    # ------------------------------------------------------------------ calls

    def _logits(self, out: dict[str, np.ndarray], name: str = "logits") -> np.ndarray:
        """(T, V) float32 from one output or from the split head's outputs name_0..name_{n-1}."""
        if self.n_logits == 1:
            rows = np.asarray(out[name][0], np.float32)
        else:
            rows = np.concatenate([np.asarray(out[f"{name}_{j}"][0], np.float32) for j in range(self.n_logits)], -1)
        if self.kept is not None and rows.shape[-1] != self.kept.size:
            raise ValueError(f"the package returns {rows.shape[-1]} logits per row but records {self.kept.size} kept "
                             "ids: it is corrupt; rebuild it with `mirror-mlx convert`")
        return rows

    def token(self, row: np.ndarray) -> int:
        """The greedy token id of one logit row (through the kept ids of a trimmed head)."""
        j = int(np.argmax(row))
        return j if self.kept is None else int(self.kept[j])

    # ------------------------------------------------------------------ committed prefix

    def sync(self, context: Sequence[int]) -> int:
        """Make the cache hold exactly `context` (the common prefix kept); returns the `extend` calls it took."""
        S, E = self.shapes.context, self.shapes.chunk
        n = len(context)
        if n > S:
            raise ValueError(
                f"the context has {n} tokens but this Core ML draft was built for {S}; "
                f"rebuild it with `mirror-mlx convert --context {max(n, 2 * S)}` or shorten the prompt"
            )
        keep, calls = common_prefix(self.cached, context), 0
        while keep < n:
            start = keep if keep + E <= n else max(0, n - E)  # end-aligned: re-writes equal rows
            chunk = list(context[start : start + E])
            real = len(chunk)
            ids = np.array(chunk + [0] * (E - real))
            pos = start + np.arange(E)
            mask = np.full((S + E, E), NEG, np.float32)
            mask[:start, :] = 0.0
            mask[S:, :] = np.where(np.arange(E)[:, None] <= np.arange(E)[None, :], 0.0, NEG)
            logits = self._logits(self.runner.call("extend", {
                "input_ids": ids.astype(np.int32)[None, :], "positions": pos.astype(np.int32),
                "write_pos": np.array([start], np.int32), "mask": mask.astype(np.float16)[None]}))
            if self.keep_trace:
                for i in range(real):
                    self.trace.extend[start + i] = logits[i].copy()
            keep = start + real
            calls += 1
        self.cached = list(context)
        return calls

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
        check_stems(stems)
        if not 1 <= gamma <= self.shapes.gamma:
            raise ValueError(f"gamma {gamma} is outside 1..{self.shapes.gamma}, what this Core ML draft was built "
                             f"for; rebuild it with `mirror-mlx convert --gamma {max(gamma, 1)}`")
        extends = self.sync(context)
        windows, calls = self._rollout_groups(len(context), [[int(t) for t in st] for st in stems], gamma)
        return Rollout(windows=windows, forwards=extends + calls, tokens=gamma)

    def _rollout_groups(self, n_ctx: int, stems: list[list[int]], gamma: int) -> tuple[list[list[int]], int]:
        """Split the stems when one batched rollout might not fit the scratch slots."""
        nodes, leaves = self._trie(stems)
        max_calls = self.shapes.scratch // self.shapes.rows
        if len(stems) == 1 or self._rollout_once(n_ctx, nodes, leaves, gamma, dry=True)[1] <= max_calls:
            return self._rollout_once(n_ctx, nodes, leaves, gamma)
        half = len(stems) // 2
        w1, c1 = self._rollout_groups(n_ctx, stems[:half], gamma)
        w2, c2 = self._rollout_groups(n_ctx, stems[half:], gamma)
        return w1 + w2, c1 + c2

    def _rollout_once(self, n_ctx: int, nodes: list[_Node], leaves: list[int], gamma: int,
                      dry: bool = False) -> tuple[list[list[int]], int]:
        """One batched rollout. dry=True counts the calls it needs at worst (no guess accepted)."""
        S, B, W, NS = self.shapes.context, self.shapes.rows, self.shapes.scratch, self.shapes.streams
        nodes = [_Node(n.token, n.parent, n.depth) for n in nodes]
        top = max(n.depth for n in nodes) + gamma + NS
        if n_ctx + top > S + W and not dry:
            raise ValueError(f"context ({n_ctx}) + stem + gamma ({top}) exceeds the package's {S + W} "
                             "positions; rebuild it with a larger --context")
        branches = {leaf: _Branch(leaf) for leaf in dict.fromkeys(leaves)}  # unique leaves
        trie_left = list(range(len(nodes)))
        calls = 0
        while any(len(b.window) < gamma for b in branches.values()):
            if (calls + 1) * B > W and not dry:
                raise ValueError("rollout does not fit the package's scratch slots; use fewer or shorter stems")
            batch = trie_left[:B]
            trie_left = trie_left[len(batch):]
            for b in branches.values():  # whole chains only, first come first served
                if b.chain and len(batch) + len(b.chain) <= B:
                    batch += b.chain
            row_of = {u: r for r, u in enumerate(batch)}
            write = S + calls * B
            main, streams = (None, None) if dry else self._rollout_call(n_ctx, nodes, batch, row_of, write)
            for r, u in enumerate(batch):
                nodes[u].slot = write + r
            for b in branches.values():
                if len(b.window) >= gamma:
                    continue
                fed = b.chain or [b.last]  # no chain yet: the leaf itself, for its first token
                if fed[0] in row_of:
                    self._advance(b, fed, row_of, main, streams, nodes, gamma, dry)
            calls += 1
        return [branches[leaf].window[:gamma] for leaf in leaves], calls

    def _advance(self, b: _Branch, fed: list[int], row_of: dict[int, int], main: Optional[np.ndarray],
                 streams: Optional[np.ndarray], nodes: list[_Node], gamma: int, dry: bool) -> None:
        """Take the tokens a processed chain earns and queue the branch's next chain.

        fed = [leaf] or [main token, guess_1, ...]: the main prediction at row i checks fed[i+1]."""
        NS = self.shapes.streams
        if dry:
            keep, gained, guesses = 0, [0], [0] * NS
        else:  # fed[0] is the leaf (a stem token) or the main token already in the window
            assert main is not None, "a processed chain has its logits"
            keep, gained = self_verify([nodes[u].token for u in fed], [self.token(main[row_of[u]]) for u in fed])
            guesses = []
            if NS:
                assert streams is not None, "a package with streams returns their logits"
                guesses = [self.token(streams[j, row_of[fed[keep]]]) for j in range(NS)]
        b.window += gained
        tok = gained[-1]
        b.last = fed[keep]
        need = gamma - len(b.window)
        b.chain = []
        for t in ([tok] + guesses)[: max(0, need)]:  # a chain of c rows earns at most c tokens
            parent = b.chain[-1] if b.chain else b.last
            nodes.append(_Node(t, parent, nodes[parent].depth + 1))
            b.chain.append(len(nodes) - 1)

    def _rollout_call(self, n_ctx: int, nodes: list[_Node], batch: list[int], row_of: dict[int, int],
                      write: int) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """One `rollout` call; returns main logits (B, V) and stream logits (NS, B, V) or None."""
        S, B, W, NS = self.shapes.context, self.shapes.rows, self.shapes.scratch, self.shapes.streams
        K = S + W
        ids = np.zeros(B, np.int64)
        pos = np.zeros(B, np.int64)
        mask = np.full((K + B, B), NEG, np.float32)
        mask[:n_ctx, : len(batch)] = 0.0
        paths = []
        for r, u in enumerate(batch):
            ids[r], pos[r] = nodes[u].token, n_ctx + nodes[u].depth
            a, path = u, []
            while a != -1:
                mask[K + row_of[a] if a in row_of else nodes[a].slot, r] = 0.0
                path.append(nodes[a].token)
                a = nodes[a].parent
            paths.append(tuple(reversed(path)))
        for r in range(len(batch), B):
            mask[K + r, r] = 0.0  # padding rows see themselves only
        inputs: dict[str, np.ndarray] = {"input_ids": ids.astype(np.int32)[None, :], "positions": pos.astype(np.int32),
                  "write_pos": np.array([write], np.int32), "mask": mask.astype(np.float16)[None]}
        if NS:  # stream (r, j): what main row r sees, plus streams 1..j of row r
            smask = np.full((K + B + B * NS, B * NS), NEG, np.float32)
            for j in range(NS):
                smask[: K + B, j * B : (j + 1) * B] = mask
                for jj in range(j + 1):
                    smask[K + B + jj * B + np.arange(B), j * B + np.arange(B)] = 0.0
            inputs["stream_positions"] = np.concatenate([pos + j + 1 for j in range(NS)]).astype(np.int32)
            inputs["stream_mask"] = smask.astype(np.float16)[None]
        out = self.runner.call("rollout", inputs)
        main = self._logits(out, "logits")
        streams = self._logits(out, "stream_logits").reshape(NS, B, -1) if NS else None
        if self.keep_trace:
            for r, walked in enumerate(paths):
                self.trace.rows.append((walked, main[r].copy(), None if streams is None else streams[:, r].copy()))
        return main, streams
