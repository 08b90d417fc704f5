"""The BLAS libraries MLX can take on this machine, side by side in one run: the target's forward at 1-16 rows,
its prefill, and each distinct matmul shape of the model at 1-512 rows.

One worker process per library (MIRROR_MLX_BLAS=...), all loaded at once; the rounds take turns (the order
rotates), so the machine's drift falls on every library alike. Each worker greedy-decodes the same prompt
first and the tokens are compared (each library's are mlx-lm's own in that process; equal across libraries
is reported, not assumed: float32 sums in another order may round differently).

    .venv/bin/python scripts/blas_compare.py build/real-pair/target               # Mac analog: core 0, 1 thread
    .venv/bin/python scripts/blas_compare.py build/real-pair/target --defaults    # this machine's defaults

The Mac analog reads process CPU time (one thread, pinned: robust to other work on the other core); the
defaults read wall time (two threads: CPU time would count their waits).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r'''
import json, statistics, sys, time
import mirror_mlx
from mirror_mlx import blas
import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

path, rows, cpu = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "cpu"
clock = time.process_time if cpu else time.perf_counter
model, tok = load(path)
prompt = mx.array(tok.encode("Explain why the sky is blue in two sentences."))
tokens = [t for (t, _), _ in zip(generate_step(prompt, model, max_tokens=24), range(24))]
shapes = sorted({tuple(m.weight.shape) for _, m in model.named_modules()
                 if isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.ndim == 2})
cache = make_prompt_cache(model)
mx.eval(model(mx.array([list(range(100, 356))]), cache=cache))

def forward(n):
    t = clock(); mx.eval(model(mx.array([[5] * n]), cache=cache)); dt = clock() - t
    for c in cache:
        c.trim(n)
    return dt

def prefill():
    c = make_prompt_cache(model)
    t = clock(); mx.eval(model(mx.array([list(range(200, 456))]), cache=c)); mx.eval([x.state for x in c])
    return clock() - t

weights = {s: mx.random.normal(s) for s in shapes}
def matmul(shape, n):
    x = mx.random.normal((n, shape[1])); w = weights[shape]; mx.eval(x, w)
    mx.eval(x @ w.T)
    t = clock(); mx.eval(x @ w.T); return clock() - t

forward(1); prefill()
print(json.dumps({"status": blas.status(), "tokens": tokens, "shapes": shapes}), flush=True)
for line in sys.stdin:
    out = {f"forward {n}": statistics.median(forward(n) for _ in range(5)) for n in rows}
    out["prefill 256"] = min(prefill() for _ in range(2))
    for s in shapes:
        for n in (1, 2, 4, 8, 16, 512):
            out[f"{s[1]}x{s[0]} {n}"] = min(matmul(s, n) for _ in range(3 if n < 512 else 1))
    print(json.dumps(out), flush=True)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--libraries", default="openblas,blis", help="MIRROR_MLX_BLAS values, the first the baseline")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--defaults", action="store_true", help="this machine's defaults: every core, a thread each")
    ap.add_argument("--json", help="write every round's figures here")
    args = ap.parse_args()
    libs = args.libraries.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for var in ("OPENBLAS_NUM_THREADS", "BLIS_NUM_THREADS", "OMP_NUM_THREADS", "MIRROR_MLX_BLAS_SAID"):
        env.pop(var, None)
    if not args.defaults:
        env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    workers, heads = {}, {}
    for lib in libs:
        cmd = [sys.executable, "-c", WORKER, args.model, json.dumps(rows), "wall" if args.defaults else "cpu"]
        if not args.defaults:
            cmd = ["taskset", "-c", str(min(os.sched_getaffinity(0)))] + cmd
        workers[lib] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env=dict(env, MIRROR_MLX_BLAS=lib))
        heads[lib] = json.loads(workers[lib].stdout.readline())
    runs = {lib: [] for lib in libs}
    for r in range(args.rounds):
        for lib in libs[r % len(libs):] + libs[:r % len(libs)]:
            workers[lib].stdin.write("go\n")
            workers[lib].stdin.flush()
            runs[lib].append(json.loads(workers[lib].stdout.readline()))
    for w in workers.values():
        w.stdin.close()
        w.wait()
    med = {lib: {k: statistics.median(run[k] for run in runs[lib]) for k in runs[lib][0]} for lib in libs}
    base = libs[0]
    setting = "this machine's defaults (wall time)" if args.defaults else "Mac analog: core 0, 1 thread (CPU time)"
    print(f"{args.model}; {setting}; {args.rounds} interleaved rounds, medians; load {os.getloadavg()[0]:.1f}")
    for lib in libs:
        same = "same tokens" if heads[lib]["tokens"] == heads[base]["tokens"] else "OTHER TOKENS than " + base
        print(f"  {lib}: {heads[lib]['status']} ({same})")
    print("\n| | " + " | ".join(libs) + " | " + " | ".join(f"{lib} / {base}" for lib in libs[1:]) + " |")
    print("|---" * (2 * len(libs)) + "|")
    one = {lib: med[lib]["forward 1"] for lib in libs}
    for key in med[base]:
        kind, n = key.rsplit(" ", 1)
        if kind == "forward":
            cells = [f"{med[lib][key] * 1e3:.1f} ms (x{med[lib][key] / one[lib]:.2f})" for lib in libs]
        elif kind == "prefill":
            cells = [f"{int(n) / med[lib][key]:.0f} tok/s" for lib in libs]
        else:
            i, o = (int(v) for v in kind.split("x"))
            cells = [f"{2 * int(n) * i * o / med[lib][key] / 1e9:.1f} GFLOPS" for lib in libs]
        speed = [f"{med[base][key] / med[lib][key]:.2f}x" for lib in libs[1:]]
        print(f"| {key} | " + " | ".join(cells) + " | " + " | ".join(speed) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"heads": heads, "runs": runs}, f)


if __name__ == "__main__":
    main()
