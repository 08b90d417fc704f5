"""What position-keyed seeded sampling costs per verify: one seeded draw per row against one batched draw.

    .venv/bin/python scripts/seeded_overhead.py [--iters 200]

With a seed the draw for position p is keyed by (seed, p), so a verify samples its γ+1 rows one by one
(MLX's generator re-seeded per row) instead of in one call. This times `row_sampler` on γ+1 = 8 rows
of random log-probabilities at the demo's vocabulary (512) and Qwen3's (151,669), best of 5 rounds,
alternating, and prints the ratio and the load average (timings on a shared CPU are noisy).
The end-to-end tokens/s of a seeded and an unseeded run are not comparable: they sample different tokens.
"""

import argparse
import time

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

import mirror_mlx  # noqa: F401  (OpenBLAS before mlx)
from mirror_mlx.sampling import row_sampler


def per_call_ms(sample, logprobs, iters: int) -> float:
    t0 = time.perf_counter()
    for i in range(iters):
        sample(logprobs, 100 + i)
    return 1000 * (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    base = make_sampler(0.8, top_p=0.9)
    for vocab in (512, 151_669):
        logits = mx.random.normal((8, vocab))
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(logprobs)
        plain, seeded = row_sampler(base, None), row_sampler(base, 3)
        best = {"plain": float("inf"), "seeded": float("inf")}
        for _ in range(5):
            best["plain"] = min(best["plain"], per_call_ms(plain, logprobs, args.iters))
            best["seeded"] = min(best["seeded"], per_call_ms(seeded, logprobs, args.iters))
        print(f"vocab {vocab:7d}: unseeded {best['plain']:.3f} ms | seeded {best['seeded']:.3f} ms per 8-row verify"
              f" | ratio {best['seeded'] / best['plain']:.2f}")
    with open("/proc/loadavg") as f:
        print("load average:", " ".join(f.read().split()[:3]))


if __name__ == "__main__":
    main()
