"""The recycled draft on the real model: SmolLM2-135M-Instruct (`make real-pair`) with draft_model="recycle"
(no draft model: the target's own top candidates from earlier forwards, grown into a token tree and verified
in one forward), against mlx-lm's generate_step, T = 0, on Spec-Bench's evaluation part (every category)
and the code-edit set.

Settings: the Mac analog (OPENBLAS_NUM_THREADS=1, every thread of this process on core 0: the target has the
machine's one compute core, as the GPU on a Mac) or, with `--defaults`, this machine's defaults (nothing
pinned, OpenBLAS on its own threads).

Rows: mlx-lm ar; the recycled tree as the product runs it (`lookup=False`: the tree alone, sized by the
verify widths it timed on its first prefill); the same with the prompt lookup as the tree's first branch
(the product's default for draft_model="recycle"); the lookup alone (draft_model="lookup"); and, for the
size table, the tree alone at fixed row costs (`--sweep`: a verify of n + 1 rows priced 1 + row_cost · n,
so row_cost 0 grows every node the table fills, up to recycle.NODES).

The table is warmed first, as a user's pipeline is after some use: one reply to `--warm` training-part
prompts of every category (the evaluation part is never read before it is measured). Every tree row of
every prompt starts from that warmed table, so no row learns from another row's reply to the same prompt
(a pipeline would: its table lives as long as it does). Every row's tokens
must equal generate_step's (an AssertionError names the row and prompt). Per prompt the rows run once, in an
order rotated by prompt. Columns: tok/s (median over prompts), × mlx-lm ar (median over prompts of the
ratio on the same prompt), tokens per target forward (pooled: accepted + the target's own), nodes verified
per step (pooled).

    make setup && make real-pair
    .venv/bin/python scripts/recycle_real.py --out docs/bench/recycle-real.md
    .venv/bin/python scripts/recycle_real.py --defaults --out docs/bench/recycle-real-defaults.md
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = "--defaults" in sys.argv
if not DEFAULTS:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(ROOT / "scripts"))

import argparse  # noqa: E402
import copy  # noqa: E402
import shlex  # noqa: E402
import time  # noqa: E402
from statistics import median  # noqa: E402

import mirror_mlx  # noqa: E402
from lookup_real import cap, prompts_for  # noqa: E402
from mirror_mlx.bench.baselines import run_ar  # noqa: E402
from mirror_mlx.bench.machine import machine  # noqa: E402
from mirror_mlx.pipeline import Pipeline  # noqa: E402
from mirror_mlx.prompts import spec_bench_part  # noqa: E402

TARGET = ROOT / "build/real-pair/target"


def pin_all(cpu: int) -> None:
    """Every thread of this process (and those it starts later) on `cpu`."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {cpu})


def rows(sweep: list[float]) -> dict:
    """label -> (pipeline, generate options)."""
    r = {"recycle (tree alone)": ("recycle", dict(lookup=False)),
         "recycle + lookup": ("recycle", dict()),
         "lookup alone": ("lookup", dict())}
    r.update({f"tree, row_cost {c:g}": ("recycle", dict(lookup=False, row_cost=c)) for c in sweep})
    return r


def run(label, kind, pipes, ids, n, eos) -> dict:
    if kind is None:
        r = run_ar(pipes["recycle"].model, ids, n, stop_tokens=eos)
        return dict(tokens=r.tokens, tps=r.tokens_per_s, fwd=len(r.tokens), nodes=0, steps=len(r.tokens))
    name, kw = kind
    if name == "recycle":  # every tree row starts from the warmed table: none learns from another's reply
        pipes[name].engine.recycled = copy.deepcopy(pipes["warm"])
    s = pipes[name].generate(ids, max_tokens=n, **kw)
    st = s.stats
    return dict(tokens=list(s.tokens), tps=st.tokens_per_second, fwd=st.target_forwards, nodes=st.proposed,
                steps=st.steps)


def summary(samples: list[dict], base: list[dict]) -> str:
    tps = median(s["tps"] for s in samples)
    ratio = median(s["tps"] / b["tps"] for s, b in zip(samples, base))
    per_fwd = sum(len(s["tokens"]) for s in samples) / sum(s["fwd"] for s in samples)
    nodes = sum(s["nodes"] for s in samples) / max(sum(s["steps"] for s in samples), 1)
    return f"{tps:.1f} | {ratio:.2f} | {per_fwd:.2f} | {nodes:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=1, help="evaluation prompts per category")
    ap.add_argument("--warm", type=int, default=2, help="training prompts per category that warm the table")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-chars", type=int, default=1500)
    ap.add_argument("--sweep", default="0,0.01,0.03,0.1", help="fixed row costs for the size table ('' for none)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--defaults", action="store_true", help="this machine's defaults: nothing pinned")
    args = ap.parse_args()
    if not DEFAULTS:
        pin_all(0)
    t0, load0 = time.time(), os.getloadavg()
    sweep = [float(c) for c in args.sweep.split(",") if c]
    rec = mirror_mlx.load(str(TARGET), draft_model="recycle")
    pipes = {"recycle": rec, "lookup": Pipeline(rec.model, rec.tokenizer, None, name="lookup", draftless="lookup")}
    if not DEFAULTS:
        pin_all(0)  # (the pipelines' worker threads too)
    eos = tuple(rec.tokenizer.eos_token_ids)
    cats = sorted({p.category for p in spec_bench_part("eval")}) + ["code_edit"]
    enc = lambda cat, text: rec.encode(cap(cat, text, args.max_chars))  # noqa: E731
    n = args.max_tokens
    for cat in cats:  # the table warmed on the training part (and the last code-edit rows)
        for text in prompts_for(cat, args.warm, "train"):
            rec.generate(enc(cat, text), max_tokens=n, lookup=False)
    widths = rec.engine.recycled.widths
    pipes["warm"] = copy.deepcopy(rec.engine.recycled)
    labels = ["mlx-lm ar"] + list(rows(sweep))
    kinds = {"mlx-lm ar": None, **rows(sweep)}
    results = {cat: {lab: [] for lab in labels} for cat in cats}
    for cat in cats:
        for i, text in enumerate(prompts_for(cat, args.limit, "eval")):
            ids = enc(cat, text)
            order = labels[i % len(labels):] + labels[: i % len(labels)]
            done = {lab: run(lab, kinds[lab], pipes, ids, n, eos) for lab in order}
            for lab in labels:
                assert done[lab]["tokens"] == done["mlx-lm ar"]["tokens"], f"{lab} differs from generate_step: {cat}"
                results[cat][lab].append(done[lab])
            print(f"{cat} #{i}: {len(ids)} prompt tokens; "
                  + ", ".join(f"{lab} {done[lab]['tps']:.1f}" for lab in labels), flush=True)
    head = "| row | " + " | ".join(["tok/s", "× mlx-lm ar", "tokens / forward", "nodes / step"]) + " |"
    lines = ["Overall (every prompt):", "", head, "|---|---:|---:|---:|---:|"]
    every = lambda lab: [s for cat in cats for s in results[cat][lab]]  # noqa: E731
    for lab in labels:
        lines.append(f"| {lab} | {summary(every(lab), every('mlx-lm ar'))} |")
    lines += ["", "Per category, × mlx-lm ar (tokens / forward):", "",
              "| category | " + " | ".join(labels[1:]) + " |", "|---|" + "---:|" * (len(labels) - 1)]
    for cat in cats:
        base = results[cat]["mlx-lm ar"]
        cells = []
        for lab in labels[1:]:
            s = results[cat][lab]
            cells.append(f"{median(a['tps'] / b['tps'] for a, b in zip(s, base)):.2f} "
                         f"({sum(len(a['tokens']) for a in s) / sum(a['fwd'] for a in s):.2f})")
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    m, load1 = machine(), os.getloadavg()
    one = widths[1] if widths else None
    head_lines = [
        f"Command: `{shlex.join(['.venv/bin/python', 'scripts/recycle_real.py'] + sys.argv[1:])}` "
        f"({time.strftime('%Y-%m-%d %H:%M', time.gmtime(t0))} UTC, {(time.time() - t0) / 60:.0f} min); "
        f"mirror-mlx at {m['commit']}, MLX {m['mlx']}, mlx-lm {m['mlx_lm']}, {m['cpu']}, {m['cpus']} CPUs.",
        f"Setting: {'this machine' + chr(39) + 's defaults (nothing pinned)' if DEFAULTS else 'Mac analog (one BLAS thread, every thread on core 0)'}. "
        f"Load average before {load0[0]:.2f}, after {load1[0]:.2f}.",
        "Verify cost by rows, as the pipeline timed it on its first prefill (× a one-row forward of "
        f"{1000 * one:.0f} ms): " + ", ".join(f"{r} rows ×{t / one:.2f}" for r, t in sorted(widths.items()))
        if widths else "Verify widths: not timed.",
        f"Table warmed on {args.warm} training prompts per category; {args.limit} evaluation prompt(s) per "
        f"category, {n} tokens, T = 0.", ""]
    text = "\n".join(head_lines + lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    for p in (rec, pipes["lookup"]):
        p.close()


if __name__ == "__main__":
    main()
