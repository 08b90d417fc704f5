"""How predictable each prompt set is for the draft: tokens a greedy step commits per window γ.

The demo pair and its widened copy compute the same function, so this runs on the small one. Compares
the bench's TinyStories openings (the first ten held-out), tune's calibration openings, the last 40
(tune's pool) and all held-out openings; then the 5-95 % range of γ=3 over random subsets of the pool.

    .venv/bin/python scripts/acceptance_sets.py
"""

import random

from mirror_mlx.tune import calibrate
from mirror_mlx.corpus import load_split
from mirror_mlx.tune.cost_model import Acceptance
from mirror_mlx.pipeline import load

GAMMAS = (1, 2, 3, 5, 7)


def main() -> None:
    pipe = load()
    try:
        prompts = [pipe.encode(t) for t in load_split().held_out]
        traces = [calibrate.trace(pipe, p, 48, [], max(GAMMAS))[0] for p in prompts]
        calibration = [prompts.index(p) for p in calibrate.calibration_prompts(pipe, calibrate.TuneConfig().prompts)]
    finally:
        pipe.close()

    def tokens(idx) -> str:
        acc = Acceptance([traces[i] for i in idx])
        return ", ".join(f"γ={g} {acc.mean_tokens(g):.2f}" for g in GAMMAS)

    n = len(traces)
    print(f"bench's TinyStories (held-out 0-9): {tokens(range(10))}")
    print(f"tune's calibration openings {calibration}: {tokens(calibration)}")
    print(f"tune's pool (last 40): {tokens(range(n - 40, n))}")
    print(f"all {n} held-out openings: {tokens(range(n))}")
    rng = random.Random(0)
    for k in (4, 8, 16):
        vals = sorted(Acceptance([traces[i] for i in rng.sample(range(n - 40, n), k)]).mean_tokens(3) for _ in range(200))
        print(f"γ=3 over 200 random sets of {k} pool openings: 5-95 % {vals[10]:.2f}-{vals[190]:.2f}")


if __name__ == "__main__":
    main()
