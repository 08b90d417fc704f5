"""Across Macs: the target sharded over MLX distributed (`mlx.launch`), the draft beside rank 0.

Every rank runs the same engine over its shard of the target (mlx-lm's `sharded_load`: tensor parallel
through `model.shard(group)` where the family has it, else, or with `pipeline=True`, mlx-lm's split by
layers, where the exit's stage shares its top-κ: `StageTargetSide`, docs/design.md §8), so every rank runs
the same forwards and, from the same reduced logits, decides the same tokens (the ring backend's
`all_sum` gives every rank the same bits; a rank that disagrees is stopped, see `MirrorHost`). Only rank 0
runs a draft host. Its answers reach the other ranks through one small collective per request: an
`all_sum` of an int32 array that only rank 0 fills (`SharedHost` sends, `MirrorHost` receives: the same
interface as mirror_mlx/drafts/host.py's DraftHost, so the engine does not know it is distributed).

A server (`mirror-mlx serve` under the launcher): rank 0 serves HTTP with its pipeline `leading`, the other
ranks `follow` it. Each request rank 0 starts (its ids, options and what its target cache holds) and each
step, or an early stop, is told through the same kind of all_sum before it runs, so every rank runs the
same generations step by step, one request at a time.

Faults: a rank that dies makes MLX's ring raise on the others ("connection to a peer was lost"), and
`mlx.launch` stops every rank once one exits with an error; a rank that stalls is ended by the watchdog
(`MIRROR_MLX_DIST_TIMEOUT` seconds without a step, 120 by default). Either way each rank ends its draft
host, unlinks its shared memory and exits with one line on stderr.
"""

from importlib import import_module

# (light: a call in one process asks group()); `x as x` marks a re-export
from .group import comm_per_forward as comm_per_forward, group as group, launched as launched, share as share

_FROM = {"die": "faults", "end_with_launcher": "faults", "lost_peer": "faults", "stop_within_grace": "faults",
         "serve_follower": "follow", "DistributedPipeline": "pipeline", "load": "pipeline",
         "quiet_other_ranks": "pipeline"}
__all__ = sorted([*_FROM, "comm_per_forward", "group", "launched", "share"])


def __getattr__(name: str):
    """The ranks' machinery (pipeline, faults, follower) loads on first use: not in a call in one process."""
    if name not in _FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(import_module(f".{_FROM[name]}", __name__), name)
    return value
