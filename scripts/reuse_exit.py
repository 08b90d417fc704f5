"""Reuse and fallback rates of the mirror engine on the demo pair: bare head, excluded-token rule, adapter + rule.

    .venv/bin/python scripts/reuse_exit.py --n 50 --max-tokens 64

Same held-out TinyStories openings as `mirror-mlx omega`, temperature 0, defaults κ = 8, γ = 7,
ℓ_e = N/2. The "bare" variant turns the excluded-token rule off (`exclude_drafted=False`, a
measurement switch only). Every variant's tokens
must equal the bare variant's (the adapter and the rule change only which branches are prepared).
"""

import argparse
import time

import mirror_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)
from mirror_mlx.corpus import load_split
from mirror_mlx.demo_pair import EXIT_ADAPTER as ADAPTER
from mirror_mlx.stats import Stats
from mirror_mlx.pipeline import load


def run(texts, max_tokens, adapter, rule):
    pipe = load(exit_adapter=adapter or "none")
    tot, outs = Stats(), []
    try:
        for text in texts:
            r = pipe.generate(text, max_tokens=max_tokens, exclude_drafted=rule, mode="mirror")  # reuse: mirror only
            tot += r.stats
            outs.append(r.tokens)
    finally:
        pipe.close()
    return tot, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    texts = load_split().held_out[: args.n]
    print(f"{len(texts)} held-out openings, {args.max_tokens} tokens, temperature 0, κ=8 γ=7 ℓ_e=2\n")
    print("| variant | steps | reuse | fallback | accepted/forward | engine Ω₈ (mass in C_A per step) |")
    print("|---|---|---|---|---|---|")
    ref = None
    for name, adapter, rule in (("bare head", None, False), ("rule", None, True), ("adapter + rule", ADAPTER, True)):
        t0 = time.perf_counter()
        tot, outs = run(texts, args.max_tokens, adapter, rule)
        ref = outs if ref is None else ref
        assert outs == ref, f"{name}: tokens differ from the bare head's"
        print(f"| {name} | {tot.steps} | {tot.reuse_rate:.3f} | {tot.fallback_rate:.3f} | "
              f"{tot.mean_accepted:.2f} | {tot.omega_kappa:.3f} |"
              f"  <!-- {time.perf_counter() - t0:.0f} s -->", flush=True)
    print("\nsame tokens in every variant: yes")


if __name__ == "__main__":
    main()
