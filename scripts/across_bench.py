"""Across Macs on loopback: ar, sd and mirror in one process and on 2 ranks of the ring backend, in one run,
plus T_comm per forward by row count (mirror_mlx.distributed.comm_per_forward).

`python scripts/across_bench.py [--tokens 64] [--prompts 3]` prints a markdown table (docs/bench/across-macs.md). It runs
the single-process half, then itself on 2 ranks set up as `mlx.launch -n 2 --backend ring` sets them up,
without the launcher process, which keeps a core busy (mirror_mlx/bench/ranks.py). Timings on a shared box
are noisy: the load average is printed beside them.
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mirror_mlx import distributed  # noqa: E402
from mirror_mlx.bench.ranks import rank0_json  # noqa: E402
from mirror_mlx.demo import DRAFT, EXIT_ADAPTER, TARGET  # noqa: E402

MODES = {"ar": {}, "sd": dict(gamma=3), "mirror": dict(kappa=4, gamma=3, exit_layer=2)}


def measure(pipe, prompts: list[str], tokens: int) -> dict:
    out = {}
    for mode, knobs in MODES.items():
        pipe.generate(prompts[0], max_tokens=8, mode=mode, stop=False, **knobs)  # warm
        n, t, fwd = 0, 0.0, 0
        for p in prompts:
            r = pipe.generate(p, max_tokens=tokens, mode=mode, stop=False, **knobs)
            n, t, fwd = n + len(r.tokens), t + r.stats.decode_seconds, fwd + r.stats.target_forwards
        out[mode] = dict(tok_s=n / t, ms_per_forward=1e3 * t / fwd, tokens_per_forward=n / fwd)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3)
    args = ap.parse_args()
    from mirror_mlx.prompts import tinystories

    prompts = [p.text for p in tinystories()[: args.prompts]]
    if distributed.group() is not None:  # a rank
        pipe = distributed.load(TARGET, DRAFT, EXIT_ADAPTER)
        try:
            got = measure(pipe, prompts, args.tokens)
        finally:
            pipe.close()
        comm = {r: 1e3 * t for r, t in distributed.comm_per_forward(pipe.model, distributed.group()).items()}
        if distributed.group().rank() == 0:
            print(json.dumps(dict(modes=got, t_comm_ms=comm, layers=len(pipe.model.layers))), flush=True)
        return
    import mirror_mlx

    load0 = os.getloadavg()
    pipe = mirror_mlx.load()
    try:
        single = measure(pipe, prompts, args.tokens)
    finally:
        pipe.close()
    dist = rank0_json([sys.executable, __file__, "--tokens", str(args.tokens), "--prompts", str(args.prompts)])
    load1 = os.getloadavg()
    print(f"demo pair (stories260K + llama2xs, exit adapter ℓe=2), {len(prompts)} openings × {args.tokens} tokens, "
          f"greedy; load average {load0[0]:.2f} before, {load1[0]:.2f} after\n")
    print("| mode | 1 process tok/s | 2 ranks tok/s | 1 process ms/forward | 2 ranks ms/forward | tokens/forward |")
    print("|---|---|---|---|---|---|")
    for mode in MODES:
        a, b = single[mode], dist["modes"][mode]
        print(f"| {mode} | {a['tok_s']:.1f} | {b['tok_s']:.1f} | {a['ms_per_forward']:.1f} | {b['ms_per_forward']:.1f} "
              f"| {b['tokens_per_forward']:.2f} |")
    print("\nT_comm per forward by row count: the all_sums of one forward (2 per layer, rows × hidden float32), "
          "timed alone on 2 ranks:\n")
    print("| rows | " + " | ".join(dist["t_comm_ms"]) + " |")
    print("|---|" + "---|" * len(dist["t_comm_ms"]))
    print("| ms, one all_sum | " + " | ".join(f"{v / (2 * dist['layers']):.2f}" for v in dist["t_comm_ms"].values())
          + " |")
    print("| ms, per forward | " + " | ".join(f"{v:.1f}" for v in dist["t_comm_ms"].values()) + " |")


if __name__ == "__main__":
    main()
