"""One decode forward of a model against the rows it carries (1, 2, 4, 8 tokens after a short prompt).

Shows what a verify of γ+1 rows costs next to ar's one-row forward, and, for a small draft, whether
its forward is bound by its parameters or by per-op dispatch (compare two models' ms per layer).

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/forward_cost.py build/stories-98M build/llama2xs-8M [--rows 1,2,4,8]
"""

import sys

import mirror_mlx  # noqa: F401  (OpenBLAS preload)
import mlx.core as mx
from mlx_lm import load

from mirror_mlx.bench.cost import PROBE, forward_ms


def main() -> None:
    args = sys.argv[1:]
    rows = (1, 2, 4, 8)
    if "--rows" in args:  # e.g. --rows 1,2,3,4,5,6: γ+1 rows for γ = 1..5
        i = args.index("--rows")
        rows, args = tuple(int(r) for r in args[i + 1].split(",")), args[:i] + args[i + 2:]
    for path in args:
        model, tok = load(path)
        prompt = mx.array([tok.encode(PROBE)])
        n_layers = len(model.layers)
        cells = {r: forward_ms(model, prompt, r) for r in rows}
        print(f"{path}: " + ", ".join(f"{r} rows {ms:.1f} ms" for r, ms in cells.items())
              + f" | {cells[1] / n_layers:.2f} ms per layer at 1 row ({n_layers} layers)")


if __name__ == "__main__":
    main()
