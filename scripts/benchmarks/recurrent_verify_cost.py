"""Cost of a verify forward on recurrent state that can roll back, against a plain verify forward.

    .venv/bin/python scripts/benchmarks/recurrent_verify_cost.py [GAMMA] [REPS] [WIDTH]

Per update kind (gated delta: qwen3_next; SSM: mamba2; short convolution only: lfm2), a tiny random
float32 model (tests/models.py RECURRENT, widened to hidden 256 × WIDTH, default 1) holds a 64-token prompt. "plain" is one
forward over γ+1 rows on mlx-lm's own cache (its ArraysCache: no rollback possible); "noted" is the same
forward on mirror-mlx's RecurrentCache, then the rollback to `keep` of the rows (the worst case keeps γ:
the recurrence runs again over γ rows), everything evaluated. "capture" is the alternative mechanism: the
plain forward with mlx-lm's update run row by row, keeping the state after every row (what capturing per
position inside the update costs, whatever is accepted; the short convolution needs no capture). Interleaved,
median of REPS; ratios to plain.
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache, make_prompt_cache  # noqa: E402

import mirror_mlx  # noqa: E402,F401 (BLAS setup)
from mirror_mlx.engine import recurrent  # noqa: E402
from mirror_mlx.engine.target import trimmable_cache  # noqa: E402
from tests.models import RECURRENT, tiny_model  # noqa: E402

WIDE = {
    "gated delta (qwen3_next)": ("qwen3_next", dict(hidden_size=256, intermediate_size=512, linear_key_head_dim=64,
                                                    linear_value_head_dim=64, head_dim=64)),
    "ssm (mamba2)": ("mamba2", dict(hidden_size=256, intermediate_size=512, num_heads=8, head_dim=64, state_size=64)),
    "short conv (lfm2)": ("lfm2", dict(hidden_size=256, block_dim=256, block_ff_dim=512, num_attention_heads=4,
                                       num_key_value_heads=2)),
}


def states(cache):
    out = []
    for c in cache:
        for x in getattr(c, "caches", (c,)):
            out.extend(v for v in (x.cache if hasattr(x, "cache") else [x.keys, x.values]) if v is not None)
    return out


def saved(cache):
    return [[list(x.cache) if hasattr(x, "cache") else None for x in getattr(c, "caches", (c,))] for c in cache]


def restore(cache, snap, rows):
    for c, s in zip(cache, snap):
        for x, v in zip(getattr(c, "caches", (c,)), s):
            if isinstance(x, KVCache):
                x.trim(rows)
            elif type(x).__name__ == "ArraysCache":
                x.cache = v


def row_by_row(fn, per_token, kept):
    """mlx-lm's update `fn` run one row at a time, each row's state appended to `kept` (capture per position)."""
    import inspect

    sig = inspect.signature(fn)

    def update(*args, **kwargs):
        bound = sig.bind(*args, **kwargs).arguments
        rows = bound[per_token[0]].shape[1]
        ys = []
        for t in range(rows):
            one = {k: (v[:, t : t + 1] if k in per_token and v is not None else v) for k, v in bound.items()}
            y, bound["state"] = fn(**one)
            kept.append(bound["state"])
            ys.append(y)
        return mx.concatenate(ys, axis=1), bound["state"]

    return update


def median_times(fns, reps):
    """Median seconds of each of `fns`, interleaved (one of each per round, in turn) so that a shared
    machine's drift falls on all alike."""
    times = [[] for _ in fns]
    for r in range(reps):
        for i in range(len(fns)):
            j = (i + r) % len(fns)
            t = time.perf_counter()
            fns[j]()
            times[j].append(time.perf_counter() - t)
    return [statistics.median(t) for t in times]


def widened(wide: dict, width: int) -> dict:
    return {k: v * width if k in ("hidden_size", "intermediate_size", "block_dim", "block_ff_dim") else v
            for k, v in wide.items()}


def main(gamma: int = 4, reps: int = 50, width: int = 1):
    prompt = mx.array([[(7 * i) % 97 for i in range(64)]])
    rows = mx.array([[(3 * i + 1) % 97 for i in range(gamma + 1)]])
    print(f"load average: {open('/proc/loadavg').read().split()[:3]}; γ = {gamma}, {reps} reps, hidden "
          f"{256 * width}, median")
    for kind, (family, wide) in WIDE.items():
        model = tiny_model(family, seed=0, **widened(wide, width))
        plain, ours = make_prompt_cache(model), trimmable_cache(model)
        for cache in (plain, ours):
            model(prompt, cache=cache)
            mx.eval(states(cache))
        snap = saved(plain)

        def plain_verify():
            mx.eval(model(rows, cache=plain), states(plain))
            restore(plain, snap, gamma + 1)

        def noted_verify(keep):
            def run():
                logits = model(rows, cache=ours)
                for c in ours:
                    c.trim(gamma + 1 - keep)
                mx.eval(logits, states(ours))
                for c in ours:  # (untimed in spirit: a few slices) back to the prompt for the next rep
                    c.trim(keep)
            return run

        module = sys.modules[type(model.layers[0]).__module__]
        names = [n for n in recurrent.UPDATES if getattr(module, n, None) is not None]

        def capture_verify():
            kept: list = []
            noting = {n: getattr(module, n) for n in names}
            for n in names:
                setattr(module, n, row_by_row(recurrent.UPDATES[n][0], recurrent.UPDATES[n][1], kept))
            try:
                mx.eval(model(rows, cache=plain), states(plain), kept)
            finally:
                for n in names:
                    setattr(module, n, noting[n])
            restore(plain, snap, gamma + 1)

        for f in (plain_verify, noted_verify(gamma), noted_verify(0), capture_verify):
            f()  # warm-up (compilation)
        p, worst, none, cap = median_times([plain_verify, noted_verify(gamma), noted_verify(0),
                                            capture_verify if names else plain_verify], reps)
        print(f"{kind:26s} plain {1e3 * p:6.2f} ms   noted+rollback keep γ {1e3 * worst:6.2f} ms ({worst / p:4.2f}x)"
              f"   keep 0 {1e3 * none:6.2f} ms ({none / p:4.2f}x)   capture {1e3 * cap:6.2f} ms ({cap / p:4.2f}x)",
              flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
