"""Check `tune` against an exhaustive sweep of its own grid (auto within 5 % of the best, top-5 predictions within 15 %).

1. `calibrate.calibrate` on the calibration prompts (the last n held-out openings): its choice and predictions.
2. Every configuration of the same grid measured end to end on *other* held-out openings (the first n).
3. Report: auto's choice against the best swept configuration (ratio), auto against the best of
   ar / sd / mirror, and the prediction error of the top 5 predicted configurations; load average.

    .venv/bin/python scripts/tune_check.py                                   # demo pair
    .venv/bin/python scripts/tune_check.py --model build/stories-98M --draft-model build/llama2xs-8M
"""

import argparse
import time
from pathlib import Path


def cpu_ticks() -> list[int]:
    """/proc/stat's first line: user nice system idle iowait irq softirq steal ... (Linux; else empty)."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError):
        return []


def steal_share(t0: list[int], t1: list[int]) -> str:
    """The share of the machine's CPU time the hypervisor took between two readings (a VM's noise)."""
    d = [b - a for a, b in zip(t0, t1)]
    return f"{100 * d[7] / max(sum(d[:8]), 1):.0f} %" if len(d) > 7 else "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--exit-adapter", default=None)
    ap.add_argument("--prompts", type=int, default=4, help="calibration prompts")
    ap.add_argument("--sweep-prompts", type=int, default=4, help="held-out openings the sweep runs (the first ones)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--kappas", default="1,2,4,8")
    ap.add_argument("--gammas", default="1,2,3,5,7")
    ap.add_argument("--min-seconds", type=float, default=None,
                    help="the calibration's min_seconds (default: TuneConfig's)")
    ap.add_argument("--sweep-seconds", type=float, default=None,
                    help="decode seconds per configuration in each half of the sweep (default: min_seconds)")
    ap.add_argument("--all", action="store_true", help="the error table for every configuration, not the top 5")
    ap.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    ap.add_argument("--pin", action="store_true", help="target and draft on a core each, as `bench --pin` and "
                    "`tune --pin` run (set OPENBLAS_NUM_THREADS=1 too)")
    args = ap.parse_args()

    from mirror_mlx.tune import calibrate, report
    from mirror_mlx.corpus import load_split
    from mirror_mlx.tune.cost_model import Config, grid
    from mirror_mlx.pipeline import load

    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    cfg = calibrate.TuneConfig(prompts=args.prompts, max_tokens=args.max_tokens, kappas=ints(args.kappas),
                          gammas=ints(args.gammas))
    if args.min_seconds is not None:
        cfg.min_seconds = args.min_seconds
    sweep_s = cfg.min_seconds if args.sweep_seconds is None else args.sweep_seconds
    pipe = load(args.model, args.draft_model, exit_adapter=args.exit_adapter)
    if args.pin:
        from mirror_mlx.bench.machine import pin_threads

        print(f"pinning: {pin_threads(pipe)}", flush=True)
    load0 = Path("/proc/loadavg").read_text().split()[0]
    configs = grid(cfg.kappas, cfg.gammas, calibrate.exit_layer_candidates(pipe, cfg))  # the table's rows
    sweep_prompts = [pipe.encode(t) for t in load_split().held_out[: args.sweep_prompts]]
    half = len(sweep_prompts) // 2
    # The sweep runs half its prompts before the calibration and half after: the machine's speed drifts
    # over the half hour (10-20 % here), and a calibration at the sweep's midpoint cancels a steady drift.
    print(f"sweeping {len(configs)} configurations on {half} prompts, interleaved prompt by prompt", flush=True)
    ticks = [cpu_ticks()]
    before = calibrate.run_configs(pipe, configs, sweep_prompts[:half], args.max_tokens, min_seconds=sweep_s)
    ticks.append(cpu_ticks())
    t0 = time.perf_counter()
    prof = calibrate.calibrate(pipe, cfg)
    tune_s = time.perf_counter() - t0
    ticks.append(cpu_ticks())
    print(report.format_table(prof), flush=True)
    timings = prof.calibration["timings"]
    for name in ("verify", "window", "overhead"):
        print(f"{name}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" if not isinstance(v, dict) else
                                      f"{k} " + "/".join(f"{g}:{x * 1e3:.2f}" for g, x in v.items())
                                      for k, v in timings[name].items()), flush=True)
    print(f"calibrated in {tune_s:.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in prof.calibration["phases"].items())
          + ")", flush=True)
    print(f"sweeping on {len(sweep_prompts) - half} more prompts", flush=True)
    rows = prof.table
    after = calibrate.run_configs(pipe, configs, sweep_prompts[half:], args.max_tokens, warm_up=False,
                             min_seconds=sweep_s, sums={c: r["sums"] for c, r in before.items()})
    ticks.append(cpu_ticks())
    swept = {c: m["tokens_per_second"] for c, m in after.items()}
    pipe.close()
    load1 = Path("/proc/loadavg").read_text().split()[0]
    ar_before, ar_calibrated = before[Config("ar")]["tokens_per_second"], next(
        r["measured"] for r in rows if r["mode"] == "ar")

    top5 = [(Config(r["mode"], r["kappa"], r["gamma"], r["exit_layer"]), r) for r in rows[:5]]
    errors = [r["predicted"] / swept[c] - 1 for c, r in top5]
    real = [r["measured"] / swept[c] - 1 for c, r in top5 if r.get("measured")]
    worst = lambda xs: f"{100 * max(xs, key=abs):+.0f} %"  # noqa: E731
    ok = lambda xs: "yes" if max(map(abs, xs)) <= 0.15 else "no"  # noqa: E731
    chosen = Config(prof.mode, prof.kappa if prof.mode == "mirror" else None,
                    prof.gamma if prof.mode != "ar" else None, prof.exit_layer if prof.mode == "mirror" else None)
    best = max(swept, key=swept.get)
    by_mode = {m: max(v for c, v in swept.items() if c.mode == m) for m in ("ar", "sd", "mirror")}
    lines = [f"## tune vs an exhaustive sweep ({args.model or 'demo pair'})", "",
             f"Calibration {tune_s:.0f} s on {args.prompts} held-out openings x {args.max_tokens} tokens; sweep of all "
             f"{len(rows)} grid points on {len(sweep_prompts)} other held-out openings, half before the calibration and "
             f"half after (ar: {ar_before:.1f} tok/s in the first half, {ar_calibrated:.1f} in the calibration, "
             f"{swept[Config('ar')]:.1f} over the whole sweep). Load average {load0} -> "
             f"{load1}; CPU time taken by the hypervisor (steal): {steal_share(*ticks[0:2])} in the first half of "
             f"the sweep, {steal_share(*ticks[1:3])} in the calibration, {steal_share(*ticks[2:4])} in the second "
             "half.", "",
             f"- auto chose **{chosen.name}**: {swept[chosen]:.1f} tok/s in the sweep; the sweep's best is {best.name} "
             f"at {swept[best]:.1f} tok/s -> auto at **{swept[chosen] / swept[best]:.2f}x** the best fixed configuration",
             "- best per mode in the sweep: " + ", ".join(f"{m} {v:.1f}" for m, v in by_mode.items())
             + f" -> auto at **{swept[chosen] / max(by_mode.values()):.2f}x** the best of ar/sd/mirror",
             f"- the top 5 predictions: largest error {worst(errors)} -> within 15 %: **{ok(errors)}**",
             # the same line for real runs, no model: what the machine alone allows between calibration and sweep
             f"- the top 5's own real runs in the calibration ({len(real)} of 5 were run; no model): largest "
             f"difference {worst(real)} -> within 15 %: **{ok(real)}**", "",
             "The error splits into tokens per step (the acceptance on the calibration's text against the sweep's; "
             "greedy, so the sweep's is exact) and the step time (the timings and the machine's speed); in "
             "parentheses, each one's effect on the predicted tok/s.", "",
             "| top predicted | predicted tok/s | swept tok/s | error | tok/step predicted / swept | "
             "step ms predicted / swept | measured in the calibration | its difference |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    pct = lambda x, ref: f"{100 * (x - ref) / ref:+.0f}%"  # noqa: E731
    for r in rows if args.all else rows[:5]:
        c = Config(r["mode"], r["kappa"], r["gamma"], r["exit_layer"])
        m = r.get("measured")  # real runs, no model: how far the machine alone moves between calibration and sweep
        tok, steps, _, sec = after[c]["sums"]
        lines.append(f"| {c.name} | {r['predicted']:.1f} | {swept[c]:.1f} | {pct(r['predicted'], swept[c])} | "
                     f"{r['tokens_per_step']:.2f} / {tok / steps:.2f} ({pct(r['tokens_per_step'], tok / steps)}) | "
                     f"{r['step_ms']:.2f} / {1e3 * sec / steps:.2f} ({pct(1e3 * sec / steps, r['step_ms'])}) | "
                     + (f"{m:.1f} | {pct(m, swept[c])} |" if m else "| |"))
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
