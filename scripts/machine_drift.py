"""How far this machine's own speed moves: mlx-lm's plain greedy generation, back to back, no model of ours.

A calibration measures for tens of seconds and a sweep minutes later; neither can agree with the other
more closely than the machine agrees with itself. This runs `baselines.run_ar` (mlx-lm's generate_step)
on one opening for `--seconds` and reports how far the tokens/s of windows of 2, 10 and 45 s (the
calibration's span) lie from the whole run's.

    .venv/bin/python scripts/machine_drift.py                      # the demo target, 5 minutes
    .venv/bin/python scripts/machine_drift.py --model build/stories-98M --seconds 120
"""

import argparse
import time
from statistics import pstdev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="the target (default: the demo target)")
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--windows", default="2,10,45", help="window lengths in seconds")
    args = ap.parse_args()

    from mirror_mlx.bench.baselines import run_ar
    from mirror_mlx.corpus import load_split
    from mirror_mlx.pipeline import load

    pipe = load(args.model, None)
    model, prompt = pipe.model, pipe.encode(load_split().held_out[0])
    pipe.close()
    for _ in range(5):
        run_ar(model, prompt, args.max_tokens)
    runs = []  # (end time, generated tokens, decode seconds)
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        r = run_ar(model, prompt, args.max_tokens)
        runs.append((time.perf_counter() - start, len(r.tokens), r.decode_s))
    whole = sum(n for _, n, _ in runs) / sum(s for _, _, s in runs)
    print(f"{len(runs)} runs of {args.max_tokens} tokens in {args.seconds:.0f} s: {whole:.1f} tok/s over the whole run")
    print("| window | windows | tok/s: spread (SD) | lowest | highest | within 15 % of the whole |")
    print("|---:|---:|---:|---:|---:|---:|")
    for w in (float(x) for x in args.windows.split(",")):
        rates = []
        for k in range(int(args.seconds // w)):
            inside = [(n, s) for t, n, s in runs if k * w <= t < (k + 1) * w]
            if inside:
                rates.append(sum(n for n, _ in inside) / sum(s for _, s in inside) / whole - 1)
        if len(rates) < 2:
            continue
        within = sum(abs(x) <= 0.15 for x in rates)
        print(f"| {w:g} s | {len(rates)} | {100 * pstdev(rates):.1f} % | {100 * min(rates):+.0f} % | "
              f"{100 * max(rates):+.0f} % | {within} of {len(rates)} |")


if __name__ == "__main__":
    main()
