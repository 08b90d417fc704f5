"""A verify forward's time by rows at each OpenBLAS thread count: the real target (SmolLM2-135M-Instruct,
`make real-pair`) over a cached context, unpinned, in interleaved rounds (median of the rounds after the first).

    .venv/bin/python scripts/benchmarks/verify_threads.py [--rounds 16]

This machine's defaults run every BLAS thread; a verify's rows cost what they cost at that count. Where a
thread count is faster for some row counts than another, the rows a window or a tree can afford differ by it.
"""

import argparse
import statistics
import time

import mirror_mlx  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from mirror_mlx import blas

ROWS = (1, 2, 4, 8, 16, 32)
TEXT = "Summarize the history of the printing press and what it changed in Europe, in plain words. " * 3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=16)
    args = ap.parse_args()
    model, tokenizer = load("build/real-pair/target")
    context = tokenizer.encode(TEXT)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([context]), cache=cache))
    most = max(blas.threads().values(), default=1)

    def once(n: int) -> float:
        t = time.perf_counter()
        mx.eval(model(mx.array([context[-n:]]), cache=cache))
        seconds = time.perf_counter() - t
        trim_prompt_cache(cache, n)
        return seconds

    counts = sorted({1, most})
    times: dict = {(c, n): [] for c in counts for n in ROWS}
    try:
        for _ in range(args.rounds):
            for c in counts:
                blas.set_threads(c)
                for n in ROWS:
                    times[c, n].append(once(n))
    finally:
        blas.set_threads(most)
    print("rows | " + " | ".join(f"{c} BLAS thread{'s' * (c > 1)} (ms)" for c in counts))
    for n in ROWS:
        print(f"{n:4d} | " + " | ".join(f"{1e3 * statistics.median(times[c, n][1:]):8.1f}" for c in counts))


if __name__ == "__main__":
    main()
