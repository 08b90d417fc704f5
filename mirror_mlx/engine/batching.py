"""Token sequences of different lengths as right-padded batches, for one causal forward per batch.

Right padding is harmless for a causal model: a row only sees what comes before it, so the logits
and states at each sequence's own positions are exact. Used by the exit adapter's data, Ω_κ and the
Core ML parity check.
"""

from typing import Iterator, Sequence

import mlx.core as mx


def padded_batches(seqs: Sequence[Sequence[int]], batch_size: int) -> Iterator[tuple[int, list[list[int]], mx.array]]:
    """(index of the batch's first sequence, its sequences, their right-padded (B, L) int32 array)."""
    for i in range(0, len(seqs), batch_size):
        part = [list(s) for s in seqs[i : i + batch_size]]
        n = max(len(s) for s in part)
        yield i, part, mx.array([s + [0] * (n - len(s)) for s in part], dtype=mx.int32)
