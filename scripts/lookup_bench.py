"""Prompt lookup on the demo pair: the lookup alone and beside the draft, against ar and mlx-lm's own loops.

Two prompts: a summarization-like one (a paragraph, then a request to tell it again, whose answer copies
it) and a plain story start. Each configuration runs `--reps` times, interleaved; the table gives the
median decode tokens/s and the tokens committed per target forward, and checks every greedy output
equals mlx-lm's. Short: about a minute on two cores.

    .venv/bin/python scripts/lookup_bench.py [--max-tokens 128] [--reps 3]
    taskset -c 0 .venv/bin/python scripts/lookup_bench.py
"""

import argparse
from statistics import median

import mirror_mlx
from mirror_mlx import demo as demo_pair
from mirror_mlx.bench.baselines import run_ar, run_mlx_sd
from mirror_mlx.loading import load_model

PARAGRAPH = ("Once upon a time there was a little girl named Lily. She loved to play outside in the park with her "
             "dog Max. One day she found a big red ball under a tree. She was very happy and she played with the "
             "ball all day.")
PROMPTS = {"summarize": PARAGRAPH + "\nTell me the story again.\n" + PARAGRAPH[:20], "story": "Once upon a time"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gamma", type=int, default=3, help="sd's window with the draft (and beside the lookup)")
    args = ap.parse_args()
    pair, alone = mirror_mlx.load(), mirror_mlx.load(draft_model="lookup")
    draft, _ = load_model(str(demo_pair.DRAFT))
    n = args.max_tokens
    ours = {  # name -> (pipeline, options)
        "ar": (pair, dict(mode="ar")),
        f"sd draft γ={args.gamma}": (pair, dict(mode="sd", gamma=args.gamma)),
        "lookup alone n=3..1 γ=8": (alone, dict(mode="sd", gamma=8, ngram_max=3, ngram_min=1)),
        "lookup alone n=4..2 γ=8": (alone, dict(mode="sd", gamma=8, ngram_max=4, ngram_min=2)),
        "lookup alone n=3..1 γ=4": (alone, dict(mode="sd", gamma=4, ngram_max=3, ngram_min=1)),
        f"lookup n=3..2 + draft γ={args.gamma}": (pair, dict(mode="sd", gamma=args.gamma, lookup=True)),
        f"lookup n=3..1 + draft γ={args.gamma}": (pair, dict(mode="sd", gamma=args.gamma, lookup=True, ngram_min=1)),
        f"mirror κ=2 γ={args.gamma}": (pair, dict(mode="mirror", kappa=2, gamma=args.gamma, exit_layer=2)),
        f"mirror κ=2 γ={args.gamma} + lookup n=3..2": (pair, dict(mode="mirror", kappa=2, gamma=args.gamma, exit_layer=2,
                                                                 lookup=True)),
    }
    print(f"| prompt | run | tok/s (median of {args.reps}) | tokens per target forward | lookup accepted/proposed "
          "| draft rollouts |")
    print("|---|---|---:|---:|---:|---:|")
    for name, text in PROMPTS.items():
        ids = pair.encode(text)
        rows: dict[str, list] = {}
        for _ in range(args.reps + 1):  # the first round warms up and is not counted
            ar = run_ar(pair.model, ids, n, stop_tokens=())
            rows.setdefault("mlx-lm generate_step", []).append((ar.tokens_per_s, 1.0, "", ""))
            for k in (2, 3):
                sd = run_mlx_sd(pair.model, draft, ids, n, k)
                assert sd.tokens == ar.tokens
                rows.setdefault(f"mlx-lm speculative k={k}", []).append((sd.tokens_per_s, sd.accepted_per_forward, "",
                                                                         sd.target_forwards))
            for label, (pipe, kw) in ours.items():
                r = pipe.generate(ids, max_tokens=n, stop=False, **kw)
                assert r.tokens == ar.tokens, label
                s = r.stats
                rows.setdefault(label, []).append((s.tokens_per_second, s.mean_accepted,
                                                   f"{s.lookup_accepted}/{s.lookup_proposed}" if s.lookup else "",
                                                   s.rollouts if s.draft_host else ""))
        for label, runs in rows.items():
            runs = runs[1:]
            print(f"| {name} | {label} | {median(r[0] for r in runs):.0f} | {median(r[1] for r in runs):.2f} "
                  f"| {runs[-1][2]} | {runs[-1][3]} |")
    pair.close()
    alone.close()


if __name__ == "__main__":
    main()
