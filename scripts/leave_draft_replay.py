"""Replay auto's within-generation rule (`tune.policy.leave_draft`) at other settings, without timing noise.

At temperature 0 a generation's counts after each step (accepted, rejections, reuses, fallbacks) are
fixed by the text, so where a rule leaves the draft is too. This runs auto greedily on a bench prompt
set with the pair's saved profile (`mirror-mlx tune` first), records the counts step by step (never
leaving), then replays settings of (WITHIN_PRIOR_TOKENS, WITHIN_PRIOR_STEPS, WITHIN_MIN_JUDGED) on
them. Each generation's time is modelled from measured step times: the choice's until it leaves, then
ar's per remaining token (`--step-ms` per category from a bench run; default: the profile's table).

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/leave_draft_replay.py --model build/stories-98M \\
        --draft-model build/llama2xs-8M --exit-adapter build/stories-98M-exit1.safetensors,...
"""

import argparse
import json

SETTINGS = [(8, 4, 16), (4, 2, 12), (16, 8, 16), (8, 4, 24), (16, 8, 24), (32, 8, 24), (64, 16, 16)]


def record(pipe, prompts, max_tokens: int) -> list[dict]:
    """Per prompt: auto's configuration and its counts after each step (a recorder in place of the rule)."""
    from mirror_mlx.tune import policy

    real, runs = policy.leave_draft, []

    def recorder(prof, c):
        if real(prof, c) is None:
            return None
        runs.append({"config": (c.mode, c.kappa, c.gamma, c.exit_layer), "counts": []})
        return lambda counts: runs[-1]["counts"].append(list(counts))  # (returns None: never leaves)

    policy.leave_draft = recorder
    try:
        out = []
        for p in prompts:
            before = len(runs)
            steps = pipe.generate(p.ids, max_tokens=max_tokens, stop=False).stats.steps
            out.append(dict(runs[-1], category=p.category, steps=steps) if len(runs) > before else None)
        return out
    finally:
        policy.leave_draft = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--exit-adapter", default=None)
    ap.add_argument("--prompts", default="spec_bench")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--step-ms", default=None, help='JSON {category: [choice ms/step, ar ms/step]} from a bench run')
    args = ap.parse_args()

    from mirror_mlx.bench.run import BenchConfig, select_prompts
    from mirror_mlx.tune import cost_model, policy
    from mirror_mlx.pipeline import load

    pipe = load(args.model, args.draft_model, exit_adapter=args.exit_adapter)
    try:
        prof = policy.profile_for(pipe)
        prompts = select_prompts(BenchConfig(prompts=args.prompts, limit=args.limit, max_tokens=args.max_tokens), pipe)
        runs = record(pipe, prompts, args.max_tokens)
    finally:
        pipe.close()
    table = {cost_model.describe(cost_model.row_config(r)): r["measured_step_ms"] for r in prof.table if r.get("measured_step_ms")}
    given = json.loads(args.step_ms) if args.step_ms else {}
    print(f"{sum(r is not None for r in runs)} of {len(runs)} prompts ran a speculative choice; "
          "modelled time against the choice without leaving (>1: faster)")
    print("| prior tokens, prior steps, min judged | against never leaving | against ar | left (prompt@step: its ratio) |")
    print("|---|---:|---:|---|")
    for setting in SETTINGS:
        policy.WITHIN_PRIOR_TOKENS, policy.WITHIN_PRIOR_STEPS, policy.WITHIN_MIN_JUDGED = setting
        total = stay = plain = 0.0
        left = []
        for r in filter(None, runs):
            c = cost_model.Choice(*r["config"])
            m, a = given.get(r["category"], (table[cost_model.describe(c)], table["ar"]))
            test, t = policy.leave_draft(prof, c), r["steps"] * m  # (the last step is not asked: nothing after it)
            for k, counts in enumerate(r["counts"], 1):
                if test(counts):  # k steps of the choice committed counts[0] + k tokens; ar does the rest
                    t_left = k * m + (args.max_tokens - counts[0] - k) * a
                    left.append(f"{r['category']}@{k}: {t / t_left:.2f}")
                    t = t_left
                    break
            total += t
            stay += r["steps"] * m
            plain += args.max_tokens * a
        print(f"| {', '.join(map(str, setting))} | {stay / total:.3f} | {plain / total:.3f} | {', '.join(left)} |")


if __name__ == "__main__":
    main()
