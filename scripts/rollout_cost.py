"""What one branch rollout costs, by rows (branches) and committed context length.

Mirror-SD rolls out κ·(γ+1) branches of depth γ per step beside the target's suffix; the rollout
only hides if many rows cost about what one row costs. This prints the median ms of
`draft.rollout(context, stems, gamma)` for rows × context, with the draft already synced to the
context (as in decoding: each rollout then feeds only the spine, one forward), and each cell's
ratio to the 1-row rollout at the same context. Stems are spine-shaped like the engine's:
row i is spine[:i % (γ+1)] + [candidate i].

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/rollout_cost.py mirror_mlx/demo/llama2xs
    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/rollout_cost.py mirror_mlx/demo/ss_draft --ss

Timings are wall clock on a shared box: read the ratios, and the load average printed with them.
"""

import argparse
import statistics
import sys
import time

import mirror_mlx  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
from mlx_lm import load

from mirror_mlx.drafts.mlx_draft import MLXDraft


def stems_for(rows: int, gamma: int, vocab: int) -> list[list[int]]:
    spine = [(7 * j + 11) % vocab for j in range(gamma)]
    return [spine[: i % (gamma + 1)] + [(13 * i + 5) % vocab] for i in range(rows)]


def cost_ms(draft, context: list[int], stems: list[list[int]], gamma: int, reps: int) -> tuple[float, float]:
    """Median (wall ms, CPU ms) of one rollout; CPU time (all threads) is what a shared box distorts least."""
    draft.rollout(context, stems, gamma)  # warm-up (and the context sync)
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        draft.rollout(context, stems, gamma)
        wall.append(1000 * (time.perf_counter() - t0))
        cpu.append(1000 * (time.process_time() - c0))
    return statistics.median(wall), statistics.median(cpu)


def softmax_floor_ms(draft, rows: int, n: int, gamma: int, reps: int) -> float:
    """CPU ms of only the attention softmax a `rows`-row rollout must do: rows × heads scores over
    the n + γ/2 keys (on average), per layer and forward. Exact attention cannot skip one of them."""
    from mirror_mlx.engine.model_parts import text_model

    tm = text_model(draft.model)
    heads = tm.layers[0].self_attn.n_heads
    x = mx.random.normal((rows, heads, 1, n + gamma // 2))
    mx.eval(x)
    out = []
    for _ in range(reps):
        c0 = time.process_time()
        for _ in range(len(tm.layers) * gamma):
            mx.eval(mx.softmax(x, axis=-1, precise=True))
        out.append(1000 * (time.process_time() - c0))
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="draft model directory (mlx-lm), or an SS draft with --ss")
    ap.add_argument("--ss", action="store_true", help="load the model as a Speculative-Streaming draft")
    ap.add_argument("--rows", default="1,3,8,16,32,64")
    ap.add_argument("--context", default="64,256,448")
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if args.ss:
        from mirror_mlx.drafts.ss.draft import SSDraft

        draft = SSDraft.from_path(args.model)
    else:
        draft = MLXDraft(load(args.model)[0])
    rows = [int(r) for r in args.rows.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    vocab = draft.vocab_size
    code = sys.modules[type(draft).__module__].__file__
    print(f"draft {args.model}  gamma={args.gamma}  reps={args.reps}  mlx {mx.__version__}  code {code}")
    print(f"loadavg before: {open('/proc/loadavg').read().strip()}")
    floor = not args.ss
    print("cells: wall ms / CPU ms (median); then the CPU ratio of the last row count to the first"
          + ("; then the CPU ms of the last row count's attention softmax alone (its floor)" if floor else ""))
    print("| context | " + " | ".join(f"{r} rows" for r in rows) + f" | {rows[-1]}/{rows[0]} |"
          + (f" softmax floor, {rows[-1]} rows |" if floor else ""))
    print("|---" * (len(rows) + 2 + floor) + "|")
    for n in contexts:
        context = [(31 * i + 3) % vocab for i in range(n)]
        draft.reset()
        ms = [cost_ms(draft, context, stems_for(r, args.gamma, vocab), args.gamma, args.reps) for r in rows]
        cells = " | ".join(f"{w:.1f} / {c:.1f}" for w, c in ms)
        extra = f" {softmax_floor_ms(draft, rows[-1], n, args.gamma, args.reps):.1f} |" if floor else ""
        print(f"| {n} | {cells} | {ms[-1][1] / ms[0][1]:.2f}× |{extra}", flush=True)
    print(f"loadavg after: {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
