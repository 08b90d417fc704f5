"""A pair's cost structure: the draft's and the target's one-row decode forward, and how the target's
verify forward grows with the rows it carries. It bounds what any speculative mode can gain: a step
costs one target forward of γ+1 rows plus the draft's γ (or, in mirror, whatever of them is not hidden).

    python -m mirror_mlx.bench.cost TARGET DRAFT [--rows 1,2,4,8]
"""

import statistics
import sys
import time
from typing import TYPE_CHECKING, Sequence, cast

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from mirror_mlx.drafts.ss.model import is_ss_draft, ss_forward
from mirror_mlx.loading import load_model

if TYPE_CHECKING:
    from ..drafts.ss.model import Model as SSModel
    import mlx.nn as nn

PROBE = "Once upon a time, there was a little girl named Lily. She loved to play"  # a short prompt before the rows


def forward_ms(model: "nn.Module", prompt: mx.array, rows: int, reps: int = 15) -> float:
    """Median ms of one decode forward of `rows` tokens after `prompt` (the cache trimmed back each time)."""
    cache = make_prompt_cache(model)
    model(prompt, cache=cache)
    mx.eval([c.state for c in cache])
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(model(mx.array([[5] * rows]), cache=cache))
        times.append(time.perf_counter() - t0)
        trim_prompt_cache(cache, rows)
    return 1e3 * statistics.median(times[2:])


def ss_forward_ms(model: "SSModel", prompt: mx.array, reps: int = 15) -> float:
    """Median ms of one decode forward of a Speculative-Streaming draft: one row with its streams, over the
    prompt's keys and values (what one of its windows costs: several tokens a forward)."""
    past = [(k, v) for k, v in ss_forward(model, prompt).kv]
    mx.eval(past)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = ss_forward(model, mx.array([[5]]), prompt.shape[1], past)
        mx.eval(out.main, out.streams)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[2:])


def model_costs(path: str, rows: Sequence[int] = (1, 2, 4, 8)) -> dict[int, float]:
    """{rows: ms} for the model folder at `path` (an SS draft: its one-row forward with streams)."""
    model, tok = load_model(path)
    prompt = mx.array([tok.encode(PROBE)])
    if is_ss_draft(path):
        return {1: ss_forward_ms(cast("SSModel", model), prompt)}  # (is_ss_draft: load_model gave its Model)
    return {r: forward_ms(model, prompt, r) for r in rows}


def cost_line(target: str, draft: str, rows: Sequence[int] = (1, 2, 4, 8)) -> str:
    """One sentence: draft/target 1-row forward and the target's growth with rows."""
    t, d = model_costs(target, rows), model_costs(draft, (1,))
    growth = ", ".join(f"{r} rows {ms:.1f} ms (x{ms / t[1]:.2f})" for r, ms in t.items())
    return (f"draft 1-row forward {d[1]:.1f} ms / target 1-row forward {t[1]:.1f} ms = {d[1] / t[1]:.2f}; "
            f"target verify: {growth}")


def main(argv: list[str]) -> int:
    rows: tuple[int, ...] = (1, 2, 4, 8)
    if "--rows" in argv:
        i = argv.index("--rows")
        rows, argv = tuple(int(r) for r in argv[i + 1].split(",")), argv[:i] + argv[i + 2:]
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    print(cost_line(argv[0], argv[1], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
