"""Accepted tokens per target forward against γ, at T=0 and T=1: the ceiling of any speculative mode.

sd verifies the same greedy draft windows as mirror, so its accepted count per target forward is
what mirror can commit per step whatever the rollout costs. With a free draft and no overhead, a
step still costs one target forward of γ+1 rows (≥ ar's one-row forward: `scripts/forward_cost.py`),
so speed-up over ar ≤ accepted per forward. A property of the pair, not of the machine's load.

    .venv/bin/python scripts/acceptance_vs_gamma.py --model build/stories-98M --draft-model build/llama2xs-8M
"""

import argparse

import mirror_mlx  # noqa: F401  (OpenBLAS preload)
from mirror_mlx.pipeline import load
from mirror_mlx.prompts import load_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--prompts", type=int, default=10, help="the first N held-out TinyStories openings (the bench's)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--gammas", default="2,3,5,7,10")
    args = ap.parse_args()
    pipe = load(args.model, args.draft_model)
    prompts = [p.text for p in load_prompts("tinystories")[: args.prompts]]
    try:
        for temp in (0.0, 1.0):
            for gamma in (int(g) for g in args.gammas.split(",")):
                tok = fwd = 0
                for i, p in enumerate(prompts):
                    out = pipe.generate(p, max_tokens=args.max_tokens, mode="sd", gamma=gamma, temperature=temp, seed=i)
                    tok += out.stats.generation_tokens
                    fwd += out.stats.target_forwards
                print(f"T={temp:g} γ={gamma}: {tok / fwd:.2f} accepted per target forward ({tok} tokens, {fwd} forwards)",
                      flush=True)
    finally:
        pipe.close()


if __name__ == "__main__":
    main()
