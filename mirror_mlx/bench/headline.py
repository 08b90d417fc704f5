"""`make bench`'s headline: several `mirror-mlx bench` runs (one draft and one setting each) in one table.

Each row names its setting, its draft, its mode and the knobs and placement it ran; the baseline of a
(setting, prompt set, temperature) group is mlx-lm's speculative decoding at its best over the drafts
and k, so "× best mlx_sd" is against the best a user of mlx-lm could pick. "× ar" is against the ar of
the same run (each run interleaves its modes per prompt, so they share the machine's minutes).

    python -m mirror_mlx.bench.headline "Mac analog=bench_out/mac-llama2xs-8M/tinystories-t0" ... \
        [--cost "Mac analog=bench_out/mac-cost.txt" ...]

Runs over several categories (Spec-Bench) get a table per category after the overall one; each
`--cost SETTING=FILE` (mirror_mlx.bench.cost's line for the pair in that setting) is printed beside
every table, so the speedups read against what a draft forward and a verify cost.
"""

import json
import sys
from pathlib import Path

from .report import label


def setting_results(spec: str) -> tuple[str, dict]:
    """'SETTING=DIR' → (setting, DIR/results.json)."""
    setting, _, path = spec.partition("=")
    return setting, json.loads((Path(path) / "results.json").read_text())


def categories(runs: list[tuple[str, dict]]) -> list[str]:
    """The categories the runs' summaries hold besides `all`, in first-seen order."""
    return list(dict.fromkeys(c for _, rep in runs for c in rep["summary"] if c != "all"))


def headline(runs: list[tuple[str, dict]], category: str = "all") -> str:
    """The table (markdown) over `runs` for one category, grouped by setting, prompt set and temperature."""
    groups: dict[tuple, list[dict]] = {}
    for setting, rep in runs:
        groups.setdefault((setting, rep["config"]["prompts"], rep["config"]["temp"]), []).append(rep)
    lines = ["| setting | prompts, T | mode [draft] (knobs) | tok/s | × best mlx_sd | × ar "
             "| × mlx_sd same draft (paired) | accepted / target fwd | load |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for (setting, prompts, temp), reps in groups.items():
        sds = [(r["summary"][category]["mlx_sd"]["tokens_per_s"], r) for r in reps
               if "mlx_sd" in r["summary"].get(category, {})]
        best_sd, best_rep = max(sds, key=lambda x: x[0]) if sds else (None, None)
        for rep in reps:
            rows = rep["summary"].get(category, {})
            ar = rows["ar"]["tokens_per_s"] if "ar" in rows else None  # this run's own: the same minutes
            load_ = rep["machine"].get("loadavg_start")
            load_s = f"{load_[0]:.1f}" if load_ else "n/a"
            for mode, row in rows.items():
                name = label(mode, rep) if mode != "ar" else f"ar (mlx-lm; run with {rep.get('draft', 'draft')})"
                if mode == "mlx_sd" and rep is best_rep:
                    name = f"**{name}** (best)"
                tps = row["tokens_per_s"]
                vs_sd = f"{tps / best_sd:.2f}" if best_sd else "–"
                vs_ar = f"{tps / ar:.2f}" if ar else "–"
                paired = row.get("paired_speedup_vs_mlx_sd")
                lines.append(f"| {setting} | {prompts}, T={temp:g} | {name} | {tps:.2f} | {vs_sd} | {vs_ar} "
                             f"| {'–' if paired is None else f'{paired:.2f}'} | {row['mean_accepted']:.2f} "
                             f"| {load_s} |")
    return "\n".join(lines) + "\n"


def document(runs: list[tuple[str, dict]], costs: dict[str, str]) -> str:
    """The overall table, then one per category, each with the pair's cost structure per setting below it."""
    cost = "".join(f"\nCost structure ({setting}): {line}\n" for setting, line in costs.items())
    cats = categories(runs)
    parts = [("All prompts" if cats else "", headline(runs))] + [(f"Category: {c}", headline(runs, c)) for c in cats]
    return "\n".join((f"### {title}\n\n" if title else "") + table + cost for title, table in parts)


def main(argv: list[str]) -> int:
    costs, runs, args = {}, [], iter(argv)
    for a in args:
        if a == "--cost":
            setting, _, path = next(args, "").partition("=")
            costs[setting] = Path(path).read_text().strip()
        else:
            runs.append(setting_results(a))
    if not runs:
        print(__doc__, file=sys.stderr)
        return 2
    print(document(runs, costs), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
