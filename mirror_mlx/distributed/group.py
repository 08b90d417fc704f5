"""The launcher's group (`mlx.launch`, or mpirun) and the one small collective the ranks agree through."""

import os
import time
from typing import TYPE_CHECKING, Optional, Sequence

import mlx.core as mx

from ..engine.model_parts import text_model
from ..engine.readback import ints

if TYPE_CHECKING:
    import mlx.nn as nn

LAUNCHER_ENV = ("MLX_RANK", "OMPI_COMM_WORLD_RANK")  # set by mlx.launch (ring, jaccl) and by mpirun

_group: Optional[mx.distributed.Group] = None


def launched() -> bool:
    """Whether this process was started by a launcher (mlx.launch or mpirun)."""
    return any(name in os.environ for name in LAUNCHER_ENV)


def group() -> Optional[mx.distributed.Group]:
    """The launcher's group when it has more than one rank, else None (a single process: nothing changes)."""
    global _group
    if not launched():
        return None
    if _group is None:
        _group = mx.distributed.init()
    return _group if _group.size() > 1 else None


def share(values: Sequence[int], size: int, g: mx.distributed.Group) -> list[int]:
    """Rank 0's `values` (padded to `size`) on every rank: an all_sum that only rank 0 fills."""
    buf = [0] * size
    if g.rank() == 0:
        buf[: len(values)] = values
    out = mx.distributed.all_sum(mx.array(buf, dtype=mx.int32), group=g, stream=mx.cpu)
    return ints(out)


def rank() -> int:
    """This process's rank in the launcher's group (0 alone)."""
    return _group.rank() if _group is not None else 0


def comm_per_forward(model: "nn.Module", g: mx.distributed.Group, rows: Sequence[int] = (1, 4, 8, 16, 32),
                     reps: int = 20) -> dict[int, float]:
    """T_comm by row count: seconds of the all_sums one tensor-parallel forward of `rows` rows makes (2 per layer,
    each rows × hidden), measured alone. Every rank must call it (a collective)."""
    inner = text_model(model)
    hidden, layers = inner.args.hidden_size, len(inner.layers)
    out = {}
    for r in rows:
        x = mx.zeros((r, hidden))
        mx.eval(mx.distributed.all_sum(x, group=g, stream=mx.cpu))
        t0 = time.perf_counter()
        for _ in range(reps):
            mx.eval(mx.distributed.all_sum(x, group=g, stream=mx.cpu))
        out[r] = 2 * layers * (time.perf_counter() - t0) / reps
    return out
