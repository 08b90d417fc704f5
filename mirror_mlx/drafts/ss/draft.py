"""The Speculative-Streaming draft behind the engine's Draft protocol: several tokens per forward.

The engine's stems share one spine (stem b = ŷ_1..ŷ_{r_b} + [v_b]), the window the draft proposed one
rollout earlier, so the draft keeps the keys/values its last rollout computed and *recalls* them: the
committed prefix and most of the spine come back without a forward. Each branch is one batch row over
the shared prefix (broadcast, not copied), masked to context + ŷ_1..ŷ_{r_b}.

Forward 1 feeds every branch the few tokens no rollout computed yet, then v_b, and yields its main token
plus S stream guesses. Every later forward feeds [main token, guesses] and the main rows verify the
guesses (SS self-verification, docs/design.md §5.4): a branch gains its agreeing guesses plus the main
token after them, and that row's streams become its next guesses. Rejected rows stay in the scratch K/V,
masked out. Main rows never see stream rows, so the window is the draft's own greedy main-stream text,
reached in J ≈ ⌈γ/η̄⌉ forwards instead of γ.

With `trust_streams` (the default), the last forward's unchecked guesses complete the windows once the
slowest branch is within S tokens of γ (still valid proposals: the target verifies every token), fewer
forwards for a few accepted tokens (docs/ss_draft.md); `trust_streams=False` gives exactly the main-stream
text, as the Core ML host does.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence, Union, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache
from mirror_mlx.drafts.mlx_draft import MLXDraft, self_verify, spine_of
from mirror_mlx.engine.model_parts import common_prefix
from mirror_mlx.drafts.api import Rollout

from mirror_mlx.drafts.ss.model import Model, load_ss_draft, ss_forward


@dataclass
class RolloutStats:
    """Per-rollout detail beyond Rollout: when each branch completed its window."""

    branch_forwards: list[int] = field(default_factory=list)  # forwards until branch i had gamma tokens
    emitted: list[list[int]] = field(default_factory=list)  # tokens gained per forward, per branch
    recalled: int = 0  # tokens whose keys/values came from the previous rollout instead of a forward


@dataclass
class Extension:
    """Keys/values a rollout computed for `tokens`, which follow the first `start` tokens of its sequence:
    token t's are column cols[t] of kv (a branch's scratch is kept as it is; only a recalled one is gathered)."""

    start: int
    tokens: list[int]
    kv: list[tuple[mx.array, mx.array]]  # per layer (1, Hkv, columns, hd), at their true positions
    cols: np.ndarray


class SSDraft(MLXDraft):
    """An SS model as draft; between rollouts its cache holds committed main rows only."""

    model: Model

    def __init__(self, model: Model, trust_streams: bool = True, prefill_step_size: int = 512):
        super().__init__(model, prefill_step_size)
        self.num_streams = model.args.num_streams
        self.trust_streams = trust_streams
        self.stats = RolloutStats()

    @property
    def kv(self) -> list[KVCache]:
        """The cache as what it is: an SS model is a llama, one KVCache per layer."""
        return cast(list[KVCache], self.cache)

    def reset(self) -> None:
        super().reset()
        self.base: list[int] = []  # the last rollout's context + spine, which extensions follow
        self.extensions: list[Extension] = []

    @classmethod
    def from_path(cls, path: Union[str, Path], **kwargs) -> "SSDraft":
        model, _ = load_ss_draft(path, with_tokenizer=False)
        return cls(model, **kwargs)

    def sync(self, context: Sequence[int], extra: Sequence[int] = ()) -> int:
        """MLXDraft.sync, taking first what the last rollout computed (no forward for those tokens)."""
        self._recall(list(context) + list(extra))
        return super().sync(list(context) + list(extra))

    def rollout(self, context: Sequence[int], stems: Sequence[Sequence[int]], gamma: int) -> Rollout:
        spine = spine_of(stems)
        context, seq = list(context), list(context) + spine
        self.stats = RolloutStats([0] * len(stems), [[] for _ in stems])
        if gamma <= 0:
            self.sync(context)
            return Rollout(windows=[[] for _ in stems], forwards=0, tokens=0)
        self.stats.recalled = self._recall(seq)
        fed = 0
        if len(seq) - len(self.cached) > self.num_streams + 1:  # too many to repeat in every row
            fed = self._feed(seq[len(self.cached):])
        windows, forwards, extensions = self._branches(seq, len(context), stems, gamma)
        if len(self.cached) > len(context):  # keep the spine's keys/values for the next rollout
            n = len(self.cached) - len(context)
            extensions.append(Extension(len(context), self.cached[len(context):],
                                        [(c.state[0][..., len(context):len(self.cached), :],
                                          c.state[1][..., len(context):len(self.cached), :]) for c in self.kv],
                                        np.arange(n)))
            self._trim_to(len(context))
        self.base, self.extensions = seq, extensions
        self._recall(context)  # committed tokens the branch rows computed join the cache
        return Rollout(windows=[w[:gamma] for w in windows], forwards=fed + forwards, tokens=gamma)

    def _recall(self, seq: list[int]) -> int:
        """Grow the cache along `seq` with keys/values the last rollout computed (no forward); how many."""
        self._trim_to(common_prefix(self.cached, seq))
        kept = len(self.cached)
        shared = common_prefix(self.base, seq)  # extensions are valid where seq follows the same tokens
        while True:
            n, best, best_m = len(self.cached), None, 0
            for e in self.extensions:
                if e.start <= min(n, shared) and e.start + len(e.tokens) > n:
                    m = common_prefix(e.tokens[n - e.start:], seq[n:])
                    if m > best_m:
                        best, best_m = e, m
            if best is None:
                return len(self.cached) - kept
            i = n - best.start
            cols = mx.array(best.cols[i:i + best_m])
            for c, (k, v) in zip(self.kv, best.kv):
                c.update_and_fetch(k[:, :, cols], v[:, :, cols])
            self.cached += seq[n:n + best_m]

    def _branches(self, seq: list[int], n_context: int, stems: Sequence[Sequence[int]], gamma: int):
        """(windows, forwards, one Extension per branch): every branch rolled out from its last stem token,
        branch b seeing seq[:n_context + len(stem_b) - 1]; a complete branch leaves the batch."""
        S, P = self.num_streams, len(self.cached)
        prefix = [(c.state[0][..., :P, :], c.state[1][..., :P, :]) for c in self.kv] if P else None
        sees = [n_context + len(s) - 1 for s in stems]  # how much of seq branch b sees before v_b
        start = np.array([min(P, n) for n in sees])  # position of each row's first input
        firsts = [seq[a:n] + [s[-1]] for a, n, s in zip(start, sees, stems)]  # unseen tokens, then v_b
        L = max(map(len, firsts))
        rows = np.array([f + [0] * (L - len(f)) for f in firsts], dtype=np.int32)  # right-padded: causal
        last = np.array([len(f) - 1 for f in firsts])  # the row whose main output is the next token
        fed = [list(f) for f in firsts]  # tokens whose keys/values stand valid in each branch's scratch
        act = np.arange(len(stems))  # the branches still in the batch, in batch-row order
        offset = start.copy()
        prefix_valid = np.arange(P)[None, :] < start[:, None]
        scratch: list[tuple[mx.array, mx.array]] = []
        scratch_valid = np.zeros((len(stems), 0), dtype=bool)
        windows: list[list[int]] = [[] for _ in stems]
        extensions: list[Extension] = []
        forwards, guessing = 0, False
        while True:
            past = self._past(prefix, scratch)
            valid = mx.array(np.concatenate([prefix_valid, scratch_valid], axis=1)) if past else None
            out = ss_forward(self.model, mx.array(rows), mx.array(offset.astype(np.int32)), past, valid)
            main_ids, stream_ids = mx.argmax(out.main, axis=-1), mx.argmax(out.streams, axis=-1)
            mx.eval(main_ids, stream_ids, out.kv)
            forwards += 1
            main, streams = np.array(main_ids), np.array(stream_ids)  # (B, L), (B, S, L)
            L = rows.shape[1]
            if guessing:  # rows are [main token, last forward's guesses]: the main rows verify the guesses
                last = np.zeros(len(act), dtype=int)
            for i, b in enumerate(act.tolist()):
                if guessing:  # gains the agreeing guesses plus the main token after them
                    last[i], gained = self_verify(rows[i].tolist(), main[i].tolist())
                    fed[b] += rows[i, :last[i] + 1].tolist()
                else:  # the first forward: the main token after the branch's last input
                    gained = [int(main[i, last[i]])]
                before = len(windows[b])
                windows[b] += gained
                self._note(b, before, len(windows[b]), gamma, forwards)
            every = np.arange(len(act))
            scratch = [(k, v) for k, v in out.kv] if not scratch else [
                (mx.concatenate([sk, k], axis=2), mx.concatenate([sv, v], axis=2))
                for (sk, sv), (k, v) in zip(scratch, out.kv)]
            scratch_valid = np.concatenate([scratch_valid, np.arange(L)[None, :] <= last[:, None]], axis=1)
            short = min(len(windows[b]) for b in act)
            done = short >= gamma or (self.trust_streams and short + S >= gamma)
            if done and short < gamma:
                for j, b in enumerate(act.tolist()):
                    before = len(windows[b])
                    windows[b] += streams[j, :, last[j]].tolist()[: max(0, gamma - before)]
                    self._note(b, before, len(windows[b]), gamma, forwards)
            finished = np.array([done or len(windows[b]) >= gamma for b in act])
            for j in np.flatnonzero(finished).tolist():
                extensions.append(Extension(int(start[act[j]]), fed[act[j]],
                                            [(k[j:j + 1], v[j:j + 1]) for k, v in scratch],
                                            np.flatnonzero(scratch_valid[j])))
            if done:
                break
            rows = np.concatenate([main[every, last][:, None], streams[every, :, last]], axis=1).astype(np.int32)
            offset = offset + last + 1
            guessing = True
            keep = np.flatnonzero(~finished)
            if len(keep) < len(act):
                sel = mx.array(keep)
                scratch = [(k[sel], v[sel]) for k, v in scratch]
                act, rows, offset = act[keep], rows[keep], offset[keep]
                prefix_valid, scratch_valid = prefix_valid[keep], scratch_valid[keep]
        return windows, forwards, extensions

    def _note(self, i: int, before: int, after: int, gamma: int, forward: int) -> None:
        if before < gamma:
            self.stats.emitted[i].append(min(after, gamma) - before)
            if after >= gamma:
                self.stats.branch_forwards[i] = forward

    @staticmethod
    def _past(prefix, scratch):
        """Per layer, the parts a branch row may see: the shared prefix (batch 1), then its own scratch (kept
        apart: ss_forward's blocks join them with the new rows in one concatenation)."""
        if prefix is None and not scratch:
            return None
        layers = [([prefix[i]] if prefix is not None else []) + ([scratch[i]] if scratch else [])
                  for i in range(len(prefix if prefix is not None else scratch))]
        return [([k for k, _ in parts], [v for _, v in parts]) for parts in layers]
