"""Reuse and fallback rates of the mirror engine on the demo pair: bare head, excluded-token rule, adapter + rule.

    .venv/bin/python scripts/reuse_exit.py --n 50 --max-tokens 64

Same held-out TinyStories openings as `mirror-mlx omega`, temperature 0, defaults κ = 8, γ = 7,
ℓ_e = N/2. The engine always applies the rule; the "bare" variant swaps the engine's top-κ for one
that ignores the excluded token (a measurement switch only, in this script). Every variant's tokens
must equal the bare variant's (the adapter and the rule change only which branches are prepared).
"""

import argparse
import time
from pathlib import Path

import mirror_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)
import mirror_mlx.engine as engine
from mirror_mlx.corpus import load_openings
from mirror_mlx.pipeline import load
from mirror_mlx.target import top_k

ADAPTER = Path(mirror_mlx.__file__).parent / "demo" / "stories260K_exit2.safetensors"


def run(texts, max_tokens, adapter, rule):
    engine.top_k = top_k if rule else (lambda logits, k, exclude=None: top_k(logits, k))
    pipe = load(exit_adapter=adapter)
    tot = dict(steps=0, reuses=0, fallbacks=0, tokens=0, forwards=0, omega=0.0)
    outs = []
    try:
        for text in texts:
            r = pipe.generate(text, max_tokens=max_tokens, mode="mirror")  # reuse exists only in mirror
            s = r.stats
            tot["steps"] += s.steps
            tot["reuses"] += s.reuses
            tot["fallbacks"] += s.fallbacks
            tot["tokens"] += s.generation_tokens
            tot["forwards"] += s.target_forwards
            tot["omega"] += s.omega_sum
            outs.append(r.tokens)
    finally:
        pipe.close()
        engine.top_k = top_k
    return tot, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    texts = load_openings(held_out=True)[: args.n]
    print(f"{len(texts)} held-out openings, {args.max_tokens} tokens, temperature 0, κ=8 γ=7 ℓ_e=2\n")
    print("| variant | steps | reuse | fallback | accepted/forward | engine Ω₈ (mass in C_A per step) |")
    print("|---|---|---|---|---|---|")
    ref = None
    for name, adapter, rule in (("bare head", None, False), ("rule", None, True), ("adapter + rule", ADAPTER, True)):
        t0 = time.perf_counter()
        tot, outs = run(texts, args.max_tokens, adapter, rule)
        ref = outs if ref is None else ref
        assert outs == ref, f"{name}: tokens differ from the bare head's"
        st = max(tot["steps"], 1)
        print(f"| {name} | {tot['steps']} | {tot['reuses'] / st:.3f} | {tot['fallbacks'] / st:.3f} | "
              f"{tot['tokens'] / max(tot['forwards'], 1):.2f} | {tot['omega'] / st:.3f} |"
              f"  <!-- {time.perf_counter() - t0:.0f} s -->", flush=True)
    print("\nsame tokens in every variant: yes")


if __name__ == "__main__":
    main()
