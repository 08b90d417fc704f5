"""Prompt lookup on the real pair: SmolLM2-135M-Instruct (`make real-pair`) with its shipped draft, T = 0,
Mac analog (OPENBLAS_NUM_THREADS=1; the target side and mlx-lm's baselines on core 0, the draft host on
core 1: mirror_mlx.bench.machine.pin_threads) or, with `--defaults`, this machine's defaults (nothing
pinned, OpenBLAS on its own threads), against mlx-lm's own loops and our modes without lookup. The
lookup's rows run twice: as the product runs them (each window cut to the length that pays) and with
row_cost=0 ("whole windows": every proposal verified whole, the rule alone).

Sets: Spec-Bench's evaluation part (prompts.is_eval) of summarization and rag, and code_edit
(mirror_mlx/data/code_edit.jsonl: HumanEval functions to repeat with a parameter renamed); `--check` adds
other Spec-Bench categories (evaluation part), where the question is whether auto with lookup available
stays at the best mode without it. Each prompt goes through the target's chat template. A document longer
than `--max-chars` characters is cut at a sentence end before that (summarization keeps its
"Summarize:" head, rag its question at the end), so a long article's prefill, run by every row, stays
within the time. Generation ends at the end-of-sequence token or `--max-tokens`.

Per prompt every row runs once, interleaved (the order rotated by prompt), after a warm-up round on
Spec-Bench training-part prompts, which also picks mlx-lm's best num_draft_tokens among `--ks`. Every
row's tokens must equal mlx-lm's generate_step's (an AssertionError names the row and prompt). Columns:
decode tok/s (median over prompts), × mlx-lm ar and × our best mode without lookup (median over prompts
of the ratio on the same prompt), accepted tokens per target forward (pooled; the correction counted),
lookup accepted / proposed and the proposals held back (pooled).

    make setup && make real-pair
    .venv/bin/python scripts/lookup_real.py --limit 4 --max-tokens 64 --check writing,qa,math_reasoning \
        --check-limit 3 --out docs/bench/lookup-real.md
    .venv/bin/python scripts/lookup_real.py --defaults --limit 4 --max-tokens 64 --check writing,qa,math_reasoning \
        --check-limit 3 --out docs/bench/lookup-real-defaults.md

The profile auto and the explicit modes without knobs read is `mirror-mlx tune --pin --quick`'s (without
--pin under --defaults; its budget raised to 120 s, MIRROR_MLX_QUICK_BUDGET, as a shared 2-core box passed
30 s), which the script runs first when MIRROR_MLX_CACHE (by default build/lookup-real/cache, or
cache-defaults, so a run does not read the user's own) holds no profile yet.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = "--defaults" in sys.argv  # this machine's defaults: nothing pinned, OpenBLAS on its own threads
if not DEFAULTS:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # the Mac analog: one compute thread per MLX stream
os.environ.setdefault("MIRROR_MLX_CACHE", str(ROOT / ("build/lookup-real/cache" + ("-defaults" if DEFAULTS else ""))))

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from statistics import median  # noqa: E402

import mirror_mlx  # noqa: E402
from mirror_mlx.bench.baselines import run_ar, run_mlx_sd  # noqa: E402
from mirror_mlx.bench.cost import cost_line  # noqa: E402
from mirror_mlx.bench.machine import machine, pin_threads  # noqa: E402
from mirror_mlx.bench.run import mlx_draft  # noqa: E402
from mirror_mlx.pipeline import Pipeline  # noqa: E402
from mirror_mlx.prompts import jsonl, spec_bench_part  # noqa: E402
from mirror_mlx.tune.cost_model import describe  # noqa: E402
from mirror_mlx.tune.placement import hold  # noqa: E402

PAIR = ROOT / "build/real-pair"
CODE_EDIT = ROOT / "mirror_mlx/data/code_edit.jsonl"
MAIN_SETS = "summarization,rag,code_edit"


def cap(category: str, text: str, max_chars: int) -> str:
    """A long document cut at a sentence end before `max_chars`; the instruction kept."""
    if len(text) <= max_chars:
        return text
    if category == "rag":  # the context, then the question on the last line
        doc, q = text.rsplit("\n", 1)
        return cut(doc, max_chars - len(q) - 1) + "\n" + q
    return cut(text, max_chars)


def cut(text: str, n: int) -> str:
    ends = [m.end() for m in re.finditer(r"[.!?](\s|$)", text[:n])]
    return text[: ends[-1]].rstrip() if ends else text[:n]


def prompts_for(category: str, limit: int, part: str, skip: int = 0) -> list[str]:
    if category == "code_edit":
        rows = [p.text for p in jsonl(CODE_EDIT)]
        return rows[len(rows) - limit:] if part == "train" else rows[skip: skip + limit]  # warm-up: the last ones
    rows = [p.text for p in spec_bench_part(part) if p.category == category]
    return rows[skip: skip + limit]


def configs(main: bool) -> dict:
    """label -> (pipeline name, generate options); the labels of modes without lookup are NO_LOOKUP's.
    "whole" rows take every proposal whole (row_cost=0: the lookup's windows uncut, as before it weighed them)."""
    c = {
        "ar": ("pair", dict(mode="ar")),
        "sd (profile's γ)": ("pair", dict(mode="sd")),
        "auto": ("pair", dict(mode="auto")),
        "lookup alone, auto (sd γ=8 n=3..1)": ("alone", dict(mode="auto")),
        "lookup alone, whole windows": ("alone", dict(mode="auto", row_cost=0)),
        "auto + lookup": ("pair", dict(mode="auto", lookup=True)),
        "auto + lookup, whole windows": ("pair", dict(mode="auto", lookup=True, row_cost=0)),
    }
    if main:
        c.update({
            "lookup alone γ=8 n=4..2": ("alone", dict(mode="sd", gamma=8, ngram_max=4, ngram_min=2)),
            "sd γ=4 + lookup n=3..2": ("pair", dict(mode="sd", gamma=4, lookup=True)),
        })
    return c


NO_LOOKUP = ("ar", "sd (profile's γ)", "auto")


def run_one(label, kind, pipes, ids, n, k, draft, eos):
    if label == "mlx-lm ar":
        r = run_ar(pipes["pair"].model, ids, n, stop_tokens=eos)
        return dict(tokens=r.tokens, tps=r.tokens_per_s, fwd=r.target_forwards, la=0, lp=0, ran="")
    if label.startswith("mlx-lm sd"):
        r = run_mlx_sd(pipes["pair"].model, draft, ids, n, k, stop_tokens=eos)
        return dict(tokens=r.tokens, tps=r.tokens_per_s, fwd=r.target_forwards, la=0, lp=0, ran=f"k={k}")
    name, kw = kind
    res = pipes[name].generate(ids, max_tokens=n, **kw)
    s = res.stats
    ran = describe(s) + (" then ar" if s.left_draft else "")
    if s.mode == "ar" and s.lookup:  # auto with lookup where auto alone runs ar: the lookup beside the target
        ran = f"ar + lookup γ={s.gamma} n={kw.get('ngram_max', 3)}..{kw.get('ngram_min', 1)}"
    return dict(tokens=list(res.tokens), tps=s.tokens_per_second, fwd=s.target_forwards, la=s.lookup_accepted,
                lp=s.lookup_proposed, held=s.lookup_held, ran=ran)


def table(samples: dict, sets: list[str], labels: list[str]) -> list[str]:
    """samples[set][label] = list of per-prompt dicts (aligned by prompt)."""
    out = ["| set | row (ran as) | tok/s | × mlx-lm ar | × best without lookup | accepted / target fwd "
           "| lookup accepted / proposed, held back |", "|---|---|---:|---:|---:|---:|---:|"]
    groups = [(s, {lab: samples[s][lab] for lab in labels}) for s in sets]
    if len(sets) > 1:
        groups.append(("overall", {lab: [x for s in sets for x in samples[s][lab]] for lab in labels}))
    for name, rows in groups:
        ours = [lab for lab in NO_LOOKUP if lab in rows]
        best = max(ours, key=lambda lab: median(x["tps"] for x in rows[lab]))
        for lab in labels:
            xs = rows[lab]
            tps = median(x["tps"] for x in xs)
            vs_ar = median(x["tps"] / a["tps"] for x, a in zip(xs, rows["mlx-lm ar"]))
            vs_best = median(x["tps"] / b["tps"] for x, b in zip(xs, rows[best]))
            apf = sum(len(x["tokens"]) for x in xs) / max(sum(x["fwd"] for x in xs), 1)
            la, lp, held = (sum(x.get(k, 0) for x in xs) for k in ("la", "lp", "held"))
            ran = sorted({x["ran"] for x in xs if x["ran"]})
            shown = lab + (f" ({'; '.join(ran)})" if ran and lab not in ran else "")
            shown = f"**{shown}** (best without lookup)" if lab == best else shown
            out.append(f"| {name} | {shown} | {tps:.2f} | {vs_ar:.2f} | {vs_best:.2f} | {apf:.2f} "
                       f"| {f'{la}/{lp}' if lp else ''}{f', held {held}' if held else ''} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", default=MAIN_SETS, help="comma-separated: summarization, rag, code_edit")
    ap.add_argument("--check", default="", help="other Spec-Bench categories: auto with lookup vs without")
    ap.add_argument("--limit", type=int, default=4, help="prompts per set")
    ap.add_argument("--check-limit", type=int, default=3, help="prompts per --check category")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-chars", type=int, default=1500, help="a longer document is cut at a sentence end")
    ap.add_argument("--ks", default="1,2,3", help="mlx-lm's num_draft_tokens tried in the warm-up")
    ap.add_argument("--out", default=None, help="also write the tables (markdown) here")
    ap.add_argument("--defaults", action="store_true", help="this machine's defaults instead of the Mac analog: "
                    "nothing pinned, OpenBLAS on its default threads, tune without --pin")
    args = ap.parse_args()
    load0 = os.getloadavg()
    t_start = time.time()
    sets = [s for s in args.sets.split(",") if s]
    checks = [s for s in args.check.split(",") if s]
    cache = Path(os.environ["MIRROR_MLX_CACHE"])
    cache.mkdir(parents=True, exist_ok=True)
    if not list(cache.glob("profile-*.json")):  # auto's profile, as a user makes it: tune, Mac analog
        cmd = [str(ROOT / ".venv/bin/mirror-mlx"), "tune", "--model", str(PAIR / "target"), "--draft-model",
               str(PAIR / "draft"), "--quick"] + ([] if DEFAULTS else ["--pin"])
        print("running", " ".join(cmd), flush=True)
        env = {**os.environ, "MIRROR_MLX_QUICK_BUDGET": os.environ.get("MIRROR_MLX_QUICK_BUDGET", "120")}
        tuned = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
        print(tuned, flush=True)
        (cache / "tune.txt").write_text(tuned, encoding="utf-8")
    tune_txt = (cache / "tune.txt").read_text(encoding="utf-8") if (cache / "tune.txt").exists() else ""
    chose = next((line for line in tune_txt.splitlines() if line.startswith("chose")), "")
    pair = mirror_mlx.load(str(PAIR / "target"), str(PAIR / "draft"))
    alone = Pipeline(pair.model, pair.tokenizer, None, name="lookup", draftless="lookup")
    pipes = {"pair": pair, "alone": alone}
    pinning = {"pinned": False}
    if not DEFAULTS:  # every thread alive on core 0 (the lookup pipeline's worker too), the draft host on 1
        pinning = pin_threads(pair)
        assert pinning["pinned"], pinning
        hold(alone, pair.auto.placement_held)  # (pin_threads once: after it this process may use core 0 only)
    draft = mlx_draft(pair)
    eos = tuple(pair.tokenizer.eos_token_ids)
    enc = lambda cat, text: pair.encode(cap(cat, text, args.max_chars))  # noqa: E731
    n = args.max_tokens

    # warm-up (training part and the code-edit rows not measured): every row once, mlx-lm's k chosen
    warm = [("summarization", t) for t in prompts_for("summarization", 1, "train")] + \
           [("code_edit", t) for t in prompts_for("code_edit", 1, "train")]
    ks = [int(k) for k in args.ks.split(",")]
    for lab, kind in configs(bool(sets)).items():
        run_one(lab, kind, pipes, enc(*warm[0]), 16, None, draft, eos)
    k_tps = {k: [] for k in ks}
    for cat, text in warm:
        ids = enc(cat, text)
        ref = run_ar(pair.model, ids, 32, stop_tokens=eos)
        for k in ks:
            r = run_mlx_sd(pair.model, draft, ids, 32, k, stop_tokens=eos)
            assert r.tokens == ref.tokens, f"mlx-lm sd k={k} differs from generate_step"
            k_tps[k].append(r.tokens_per_s)
    k_best = max(ks, key=lambda k: median(k_tps[k]))
    print(f"warm-up: mlx-lm sd tok/s by k: {', '.join(f'k={k} {median(v):.2f}' for k, v in k_tps.items())}; "
          f"best k={k_best}", flush=True)

    results: dict = {}
    lengths: dict = {}

    def measure(group: str, cats: list[str], main: bool, limit: int) -> list[str]:
        labels = ["mlx-lm ar", f"mlx-lm sd k={k_best}"] + list(configs(main))
        kinds = configs(main)
        for cat in cats:
            results[cat] = {lab: [] for lab in labels}
            lengths[cat] = []
            for i, text in enumerate(prompts_for(cat, limit, "eval")):
                ids = enc(cat, text)
                lengths[cat].append(len(ids))
                order = labels[i % len(labels):] + labels[: i % len(labels)]
                done = {lab: run_one(lab, kinds.get(lab), pipes, ids, n, k_best, draft, eos) for lab in order}
                ref = done["mlx-lm ar"]["tokens"]
                for lab in labels:
                    assert done[lab]["tokens"] == ref, f"{lab} differs from mlx-lm generate_step on {cat} #{i}"
                    results[cat][lab].append(done[lab])
                print(f"{group} {cat} #{i}: {len(ids)} prompt tokens, {len(ref)} generated; "
                      + ", ".join(f"{lab} {done[lab]['tps']:.1f}" for lab in labels), flush=True)
        return table(results, cats, labels)

    lines = []
    if sets:
        lines += measure("main", sets, True, args.limit)
    if checks:
        lines += ([""] if lines else []) + measure("check", checks, False, args.check_limit)
    load1 = os.getloadavg()
    costs = cost_line(str(PAIR / "target"), str(PAIR / "draft"))
    m = machine()
    head = [f"Command: `{' '.join(['.venv/bin/python', 'scripts/lookup_real.py'] + sys.argv[1:])}` "
            f"({time.strftime('%Y-%m-%d %H:%M', time.gmtime(t_start))} UTC, {(time.time() - t_start) / 60:.0f} min); "
            f"mirror-mlx at {m['commit']}, MLX {m['mlx']}, mlx-lm {m['mlx_lm']}, {m['cpu']}, {m['cpus']} CPUs.",
            f"Load average (1/5/15 min) before: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; after: "
            f"{load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}.",
            f"Pinning: {json.dumps({k: v for k, v in pinning.items() if k in ('pinned', 'target_cpu', 'draft_cpu')})}, "
            f"{len(pinning.get('draft_host_tids', []))} draft host threads on the draft core; "
            f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}.",
            f"Profile (`mirror-mlx tune{'' if DEFAULTS else ' --pin'} --quick`): {chose or 'as found in ' + str(cache)}.",
            f"Warm-up (training part): mlx-lm sd tok/s by k: "
            f"{', '.join(f'k={k} {median(v):.2f}' for k, v in k_tps.items())}: k={k_best} kept.",
            "Prompt tokens (after the template and the --max-chars cut): "
            + "; ".join(f"{c} {', '.join(map(str, v))}" for c, v in lengths.items()) + ".",
            f"Cost structure ({'this machine' + chr(39) + 's defaults' if DEFAULTS else 'Mac analog'}, measured at the end): "
            f"{costs}.", ""]
    text = "\n".join(head + lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        raw = ROOT / "build/lookup-real" / (Path(args.out).stem + ".json")  # every sample, tokens included
        raw.parent.mkdir(parents=True, exist_ok=True)
        raw.write_text(json.dumps(
            {c: {lab: [{k: v for k, v in x.items()} for x in xs] for lab, xs in r.items()}
             for c, r in results.items()}) + "\n", encoding="utf-8")
        print(f"wrote {args.out} and {raw}")
    alone.close()
    pair.close()


if __name__ == "__main__":
    main()
