"""Mirror-SD with a branch budget B on the widened demo pair (`make demo` builds it into build/), Mac analog.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/branch_budget.py --kappa 8 --gamma 3 --budgets None,8,4,2

The target side on one core and the draft host on another (as `mirror-mlx bench --pin`), temperature 0,
the first held-out TinyStories openings (as the bench's), the budgets interleaved opening by opening so a
load change hits each alike. Every budget must give the same tokens (the budget only picks which windows
are precomputed). Prints one markdown row per B: tok/s, reuse, fallback, branches rolled out per step.
"""

import argparse
import os
import sys
from pathlib import Path

import mirror_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kappa", type=int, default=8)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--budgets", default="None,8,4,2", help="comma-separated B values; None: every branch")
    ap.add_argument("--openings", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    budgets = [None if b == "None" else int(b) for b in args.budgets.split(",")]

    from demo import widened
    from mirror_mlx.bench.machine import pin_threads
    from mirror_mlx.corpus import load_split
    from mirror_mlx.pipeline import load
    from mirror_mlx.engine.stats import Stats

    target, draft, adapters = widened(ROOT / "build")
    pipe = load(target, draft, exit_adapter=",".join(map(str, adapters)))
    try:
        print(f"pinned: {pin_threads(pipe)}", file=sys.stderr)
        knobs = dict(mode="mirror", kappa=args.kappa, gamma=args.gamma, stop=False)
        prompts = [pipe.encode(o) for o in load_split().held_out[: args.openings]]
        for b in budgets:  # warm-up
            pipe.generate(prompts[0], max_tokens=8, branches=b, **knobs)
        totals = {b: Stats() for b in budgets}
        for i, ids in enumerate(prompts):
            outs = []
            for b in budgets if i % 2 == 0 else budgets[::-1]:  # alternate directions: linear drift cancels
                r = pipe.generate(ids, max_tokens=args.max_tokens, branches=b, **knobs)
                totals[b] += r.stats
                outs.append(r.tokens)
            assert all(o == outs[0] for o in outs), f"opening {i}: a budget changed the tokens"
        print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; κ={args.kappa} γ={args.gamma}, "
              f"{args.openings} openings × {args.max_tokens} tokens, same tokens for every B")
        print("| B | tok/s | reuse | fallback | branches/step |\n|---|---|---|---|---|")
        for b, s in totals.items():
            print(f"| {b} | {s.tokens_per_second:.1f} | {100 * s.reuse_rate:.0f}% | {100 * s.fallback_rate:.0f}% "
                  f"| {s.branches_per_step:.1f} |")
    finally:
        pipe.close()


if __name__ == "__main__":
    main()
