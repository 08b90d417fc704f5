"""Would batched verification pay? Every active request drafts a window of γ, one target forward
verifies all B windows (B × (γ+1) rows), against plain batched decoding (B × 1 rows per forward).

Measured, not implemented: sd alone on held-out openings gives the tokens each verify step commits
(`mean_accepted`) and a window's draft time; timed target forwards over (B, 1) and (B, γ+1) rows on a
cache of a few prompt tokens give the rest. Batched verification's rate is then
B × mean_accepted / (t(B, γ+1) + B × draft time); plain batching's is B / t(B, 1).

    .venv/bin/python scripts/batched_verify_cost.py [--model DIR --draft-model DIR] [--gamma 4]
"""

import argparse
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

import mirror_mlx
from mirror_mlx.prompts import tinystories


def forward_seconds(model, rows: list[list[int]], width: int, reps: int) -> float:
    """Median seconds of one forward over len(rows) × width new tokens after `rows` (then trimmed back)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(rows), cache=cache))
    x = mx.array([r[-width:] for r in rows])
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(model(x, cache=cache))
        times.append(time.perf_counter() - t)
        trim_prompt_cache(cache, width)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    pipe = mirror_mlx.load(args.model, args.draft_model, exit_adapter="none") if args.model else mirror_mlx.load()
    openings = [p.text for p in tinystories()][: args.prompts]
    gen = fwd = 0
    draft = windows = 0.0
    texts = []
    for text in openings:
        r = pipe.generate(text, max_tokens=args.max_tokens, mode="sd", gamma=args.gamma)
        s = r.stats
        gen, fwd, draft, windows = gen + s.generation_tokens, fwd + s.target_forwards, draft + s.draft_seconds, \
            windows + s.rollouts
        texts.append(pipe.encode(text) + r.tokens)
    per_step, t_draft = gen / fwd, draft / max(windows, 1)
    length = min(len(t) for t in texts)
    print(f"sd alone, γ={args.gamma}: {per_step:.2f} tokens per verify step, {t_draft * 1e3:.2f} ms per window drafted")
    print("| B | plain batched step ms | verify step ms (B×(γ+1) rows) | plain tok/s | batched verification tok/s |")
    print("|---|---|---|---|---|")
    for b in (1, 2, 4):
        rows = [texts[i % len(texts)][:length] for i in range(b)]
        t1, tv = pipe.engine.target_worker.call(
            lambda: (forward_seconds(pipe.model, rows, 1, args.reps),
                     forward_seconds(pipe.model, rows, args.gamma + 1, args.reps)))
        plain, verify = b / t1, b * per_step / (tv + b * t_draft)
        print(f"| {b} | {t1 * 1e3:.2f} | {tv * 1e3:.2f} | {plain:.0f} | {verify:.0f} |")
    pipe.close()


if __name__ == "__main__":
    main()
