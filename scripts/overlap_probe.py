"""How much do the target and the draft slow each other down when they really run at the same time?

Mirror-SD's premise is that the draft's branch rollout costs nothing while it hides inside the
target's suffix. On a CPU box both run on cores that share caches and memory bandwidth, so this
measures each side alone and then both together, each on its own worker thread (as the engine
runs them), pinned to its own core as `mirror-mlx bench --pin` does.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/overlap_probe.py build/stories-98M build/llama2xs-8M
"""

import os
import statistics
import sys
import threading
import time

import mirror_mlx  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
from mlx_lm import load

from mirror_mlx.drafts.mlx_draft import MLXDraft
from mirror_mlx.model_parts import trimmable_cache
from mirror_mlx.workers import Worker


def timed(fn, reps: int) -> float:
    """Median ms of fn() over reps calls."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(1000 * (time.perf_counter() - t0))
    return statistics.median(out)


def main(target_dir: str, draft_dir: str, reps: int = 15) -> None:
    target, tok = load(target_dir)
    draft_model, _ = load(draft_dir)
    context = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play outside")
    tw, dw = Worker("target"), Worker("draft")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        tw.call(os.sched_setaffinity, 0, {cpus[0]})
        dw.call(os.sched_setaffinity, 0, {cpus[1]})
    cache = tw.call(trimmable_cache, target)
    tw.call(lambda: mx.eval(target(mx.array([context]), cache=cache)))
    draft = MLXDraft(draft_model)

    def target_step(rows: int = 3) -> None:  # one decode-like forward over `rows` tokens, then rewind
        mx.eval(target(mx.array([context[-rows:]]), cache=cache))
        for c in cache:
            c.trim(rows)

    def rollout(stems: int, gamma: int):
        return lambda: draft.rollout(context, [[5 + i] for i in range(stems)], gamma)

    shapes = [(1, 2), (3, 2), (12, 5), (64, 7)]  # (rows, gamma): plain window, κ=1 γ=2, κ=2 γ=5, κ=8 γ=7
    for s, g in shapes:
        dw.call(rollout(s, g))  # warm-up
    alone_t = tw.call(timed, target_step, reps)
    print(f"target forward over 3 rows, alone: {alone_t:.1f} ms")
    for s, g in shapes:
        alone = dw.call(timed, rollout(s, g), reps)
        stop = threading.Event()

        def busy() -> list[float]:
            times = []
            while not stop.is_set():
                t0 = time.perf_counter()
                target_step()
                times.append(1000 * (time.perf_counter() - t0))
            return times

        job = tw.submit(busy)
        time.sleep(0.05)
        together = dw.call(timed, rollout(s, g), reps)
        stop.set()
        t_times = job.result()
        print(f"draft rollout {s:3d} rows x {g} tokens: alone {alone:7.1f} ms, beside the target {together:7.1f} ms "
              f"({together / alone:.1f}x); target forward meanwhile {statistics.median(t_times):.1f} ms "
              f"({statistics.median(t_times) / alone_t:.1f}x)")
    tw.close()
    dw.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
