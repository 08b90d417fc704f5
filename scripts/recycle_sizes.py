"""How many tokens a target forward commits with the recycled tree alone, by the tree's size limits, on the real
model (SmolLM2-135M-Instruct, `make real-pair`): tokens are counted, nothing is timed, so any machine load will do.

Every tree grows every node the table fills up to the limits (row_cost 0: rows priced free, as on a machine whose
verify costs one forward up to that width). Rows: the product's limits (recycle.NODES, engine.DEPTH) and smaller ones;
the table cold (empty at each prompt, as the published run) or warmed on `--warm` training-part prompts of every
Spec-Bench category. Prompts: one evaluation-part prompt of every category, 64 tokens, and the published SmolLM2-135M
Token Recycling run's prompt (an MT-Bench coding question, 150 tokens; its README reports 2.55 cold, 2.67 warm with
an 80-node tree). T = 0; every output equals generate_step's (asserted).

    .venv/bin/python scripts/recycle_sizes.py --out docs/bench/recycle-sizes.md
"""

import argparse
import copy
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one core: another job can share the machine (nothing is timed)

import mirror_mlx  # noqa: E402
from lookup_real import cap, prompts_for  # noqa: E402
from mirror_mlx.engine import loop as engine  # noqa: E402
from mirror_mlx.proposers import recycle  # noqa: E402
from mirror_mlx.bench.baselines import run_ar  # noqa: E402
from mirror_mlx.bench.machine import machine  # noqa: E402
from mirror_mlx.prompts import spec_bench_part  # noqa: E402

TARGET = ROOT / "build/real-pair/target"
ANCHOR = ("You are given two sorted lists of size m and n. Implement a function to find the kth smallest element in "
          "the union of the two lists with linear complexity.")
LIMITS = ((recycle.NODES, engine.DEPTH), (64, 8), (16, 6))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warm", type=int, default=2, help="training prompts per category that warm the table")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.time()
    rec = mirror_mlx.load(str(TARGET), draft_model="recycle")
    eos = tuple(rec.tokenizer.eos_token_ids)
    cats = sorted({p.category for p in spec_bench_part("eval")})
    enc = lambda cat, text: rec.encode(cap(cat, text, 1500))  # noqa: E731
    for cat in cats:
        for text in prompts_for(cat, args.warm, "train"):
            rec.generate(enc(cat, text), max_tokens=64, lookup=False)
    warm = copy.deepcopy(rec.engine.recycled)
    evals = [(cat, enc(cat, t), 64) for cat in cats for t in prompts_for(cat, 1, "eval")]
    evals.append(("anchor", rec.encode(ANCHOR), 150))
    ar = {cat: run_ar(rec.model, ids, n, stop_tokens=eos).tokens for cat, ids, n in evals}
    rows = []
    for nodes, depth in LIMITS:
        recycle.NODES, engine.DEPTH = nodes, depth
        for start in ("cold", "warm"):
            per = {}
            for cat, ids, n in evals:
                rec.engine.recycled = copy.deepcopy(warm) if start == "warm" else recycle.Recycled(len(warm.table))
                s = rec.generate(ids, max_tokens=n, lookup=False, row_cost=0.0)
                assert list(s.tokens) == ar[cat], f"{nodes} nodes, {start}: {cat} differs from generate_step"
                per[cat] = (len(s.tokens), s.stats.target_forwards, s.stats.proposed / max(s.stats.steps, 1))
            bench = [per[c] for c in cats]
            overall = sum(t for t, _, _ in bench) / sum(f for _, f, _ in bench)
            nodes_step = sum(n for _, _, n in bench) / len(bench)
            rows.append((nodes, depth, start, overall, nodes_step, per))
            print(f"{nodes} nodes, depth {depth}, {start}: {overall:.2f} tokens/forward "
                  f"({nodes_step:.0f} nodes a step); anchor {per['anchor'][0] / per['anchor'][1]:.2f}", flush=True)
    m = machine()
    lines = [f"Command: `{' '.join(['.venv/bin/python', 'scripts/recycle_sizes.py'] + sys.argv[1:])}` "
             f"({time.strftime('%Y-%m-%d %H:%M', time.gmtime(t0))} UTC, {(time.time() - t0) / 60:.0f} min); "
             f"mirror-mlx at {m['commit']}, MLX {m['mlx']}, mlx-lm {m['mlx_lm']}. Tokens counted, nothing timed.",
             f"The recycled tree alone, every node the table fills up to the limits (row_cost 0); Spec-Bench: one "
             f"evaluation-part prompt of every category, 64 tokens (pooled); warm: the table after {args.warm} "
             f"training-part prompts of every category; anchor: the published run's prompt through the chat "
             "template, 150 tokens. T = 0.", "",
             "| nodes, depth | table | tokens / forward, Spec-Bench | nodes / step | anchor prompt |",
             "|---|---|---:|---:|---:|"]
    for nodes, depth, start, overall, nodes_step, per in rows:
        a = per["anchor"]
        lines.append(f"| {nodes}, {depth} | {start} | {overall:.2f} | {nodes_step:.0f} | {a[0] / a[1]:.2f} |")
    lines += ["", "Per category, tokens / forward:", "",
              "| category | " + " | ".join(f"{n}, {d}, {s}" for n, d, s, *_ in rows) + " |",
              "|---|" + "---:|" * len(rows)]
    for cat in cats + ["anchor"]:
        lines.append(f"| {cat} | " + " | ".join(f"{r[5][cat][0] / r[5][cat][1]:.2f}" for r in rows) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    rec.close()


if __name__ == "__main__":
    main()
