"""The Speculative-Streaming draft behind the engine's Draft protocol: several tokens per forward.

The engine's stems share one spine (stem b = ŷ_1..ŷ_{r_b} + [v_b]): the spine is fed once on the
committed cache, then each branch is one batch row over that shared prefix (broadcast, not copied),
masked to context + ŷ_1..ŷ_{r_b}, starting from v_b. A forward feeds every branch its pending main
token plus its S stream guesses from the previous forward. The main rows verify the guesses (SS self-verification, papers.md §3.4): branch i keeps
the agreeing prefix a_i of its guesses plus the main token after them, so it gains a_i + 1 tokens,
and that row's streams become its next guesses. Rejected rows stay in the branch's scratch K/V but
are masked out. Because main rows never see stream rows, the window is exactly the draft's own
greedy main-stream continuation (the same text a plain llama forward would give), reached in
J ≈ ⌈γ/η̄⌉ forwards instead of γ.

With `trust_streams` (the default), the last forward's unchecked stream guesses complete the
windows as soon as the slowest branch is within S tokens of γ; those windows end with guesses the
draft did not verify (still valid proposals: the target verifies every token). On the demo pair
(50 openings × 128 tokens, γ = 7, κ = 8) this cuts J from 6.8 to 4.3 for 3% fewer accepted
tokens per target forward (docs/ss_draft.md). `trust_streams=False` gives exactly the draft's
greedy main-stream text, as the Core ML host does.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence, Union

import mirror_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import trim_prompt_cache
from mirror_mlx.draft import MLXDraft, spine_of
from mirror_mlx.draft_api import Rollout

from .ss_model import Model, is_ss_draft, load_ss_draft, ss_forward  # noqa: F401  (re-exported for load)


@dataclass
class RolloutStats:
    """Per-rollout detail beyond Rollout: when each branch completed its window."""

    branch_forwards: list[int] = field(default_factory=list)  # forwards until branch i had gamma tokens
    emitted: list[list[int]] = field(default_factory=list)  # tokens gained per forward, per branch


class SSDraft(MLXDraft):
    """An SS model as draft; its prefix cache holds committed main rows only (sync as MLXDraft)."""

    def __init__(self, model: Model, trust_streams: bool = True, prefill_step_size: int = 512):
        super().__init__(model, prefill_step_size)
        self.num_streams = model.args.num_streams
        self.trust_streams = trust_streams
        self.stats = RolloutStats()

    @classmethod
    def from_path(cls, path: Union[str, Path], **kwargs) -> "SSDraft":
        model, _ = load_ss_draft(path, with_tokenizer=False)
        return cls(model, **kwargs)

    def rollout(self, context: Sequence[int], stems: Sequence[Sequence[int]], gamma: int) -> Rollout:
        spine = spine_of(stems)
        self.sync(context)
        B, S = len(stems), self.num_streams
        self.stats = RolloutStats([0] * B, [[] for _ in stems])
        if gamma <= 0:
            return Rollout(windows=[[] for _ in stems], forwards=0, tokens=0)
        self._feed(spine)  # the shared spine once, on the committed cache (one forward, counted)
        try:
            windows, forwards = self._branches(stems, len(spine), gamma)
        finally:
            trim_prompt_cache(self.cache, len(spine))
            del self.cached[len(self.cached) - len(spine):]
        return Rollout(windows=[w[:gamma] for w in windows], forwards=forwards + (1 if spine else 0),
                       tokens=gamma)

    def _branches(self, stems: Sequence[Sequence[int]], n_spine: int, gamma: int) -> tuple[list[list[int]], int]:
        """Roll every branch out from its last stem token; branch b sees context + spine[:len(stem_b) - 1].

        A branch whose window is complete leaves the batch, so the last forwards run only the
        slow branches.
        """
        S, P = self.num_streams, len(self.cached)
        prefix = [(c.state[0][..., :P, :], c.state[1][..., :P, :]) for c in self.cache] if P else None
        act = np.arange(len(stems))  # the branches still in the batch, in batch-row order
        offset = np.array([P - n_spine + len(s) - 1 for s in stems])  # position of each row's first input
        prefix_valid = np.arange(P)[None, :] < offset[:, None]
        rows = np.array([[s[-1]] for s in stems], dtype=np.int32)
        n_guess = 0
        scratch: list[tuple[mx.array, mx.array]] = []
        scratch_valid = np.zeros((len(stems), 0), dtype=bool)
        windows: list[list[int]] = [[] for _ in stems]
        forwards = 0
        while True:
            past = self._past(prefix, scratch, len(act))
            valid = mx.array(np.concatenate([prefix_valid, scratch_valid], axis=1)) if past else None
            out = ss_forward(self.model, mx.array(rows), mx.array(offset.astype(np.int32)), past, valid)
            main = mx.argmax(out.main, axis=-1)
            streams = mx.argmax(out.streams, axis=-1)
            mx.eval(main, streams, out.kv)
            forwards += 1
            main, streams = np.array(main), np.array(streams)  # (B, L), (B, S, L)
            L = rows.shape[1]
            agree = rows[:, 1:] == main[:, :L - 1]  # row 0 is given; rows 1.. are the guesses to verify
            r = np.cumprod(agree, axis=1).sum(axis=1) if n_guess else np.zeros(len(act), dtype=int)
            for i, b in enumerate(act):  # gains the r_i agreeing guesses plus the main token after them
                before = len(windows[b])
                windows[b] += rows[i, 1:r[i] + 1].tolist() + [int(main[i, r[i]])]
                self._note(b, before, len(windows[b]), gamma, forwards)
            short = min(len(windows[b]) for b in act)
            if short >= gamma:
                break
            if self.trust_streams and short + S >= gamma:
                for i, b in enumerate(act):
                    before = len(windows[b])
                    windows[b] += streams[i, :, r[i]].tolist()[: max(0, gamma - before)]
                    self._note(b, before, len(windows[b]), gamma, forwards)
                break
            scratch = [(k, v) for k, v in out.kv] if not scratch else [
                (mx.concatenate([sk, k], axis=2), mx.concatenate([sv, v], axis=2))
                for (sk, sv), (k, v) in zip(scratch, out.kv)]
            scratch_valid = np.concatenate([scratch_valid, np.arange(L)[None, :] <= r[:, None]], axis=1)
            i = np.arange(len(act))
            rows = np.concatenate([main[i, r][:, None], streams[i, :, r]], axis=1).astype(np.int32)
            offset = offset + r + 1
            n_guess = S
            keep = np.flatnonzero([len(windows[b]) < gamma for b in act])
            if len(keep) < len(act):
                sel = mx.array(keep)
                scratch = [(k[sel], v[sel]) for k, v in scratch]
                act, rows, offset = act[keep], rows[keep], offset[keep]
                prefix_valid, scratch_valid = prefix_valid[keep], scratch_valid[keep]
        return windows, forwards

    def _note(self, i: int, before: int, after: int, gamma: int, forward: int) -> None:
        if before < gamma:
            self.stats.emitted[i].append(min(after, gamma) - before)
            if after >= gamma:
                self.stats.branch_forwards[i] = forward

    @staticmethod
    def _past(prefix, scratch, B: int):
        """Per layer, the keys/values a branch row may see: shared prefix, then its own scratch."""
        if prefix is None and not scratch:
            return None
        layers = []
        for i in range(len(prefix if prefix is not None else scratch)):
            parts_k, parts_v = [], []
            if prefix is not None:
                k, v = prefix[i]
                parts_k.append(mx.broadcast_to(k, (B,) + k.shape[1:]))
                parts_v.append(mx.broadcast_to(v, (B,) + v.shape[1:]))
            if scratch:
                parts_k.append(scratch[i][0])
                parts_v.append(scratch[i][1])
            layers.append((mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2)))
        return layers
