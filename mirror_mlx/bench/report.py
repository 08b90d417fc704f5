"""What `mirror-mlx bench` writes besides results.json: results.md and PNG plots (matplotlib, Agg).

Plots are made from the report dict alone.
"""

from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")  # files only: no display on a benchmark box
import matplotlib.pyplot as plt  # noqa: E402

from .decompose import table as decompose_table
from .grid import point_name  # noqa: E402

COLORS = {"mirror": "tab:red", "sd": "tab:orange", "mlx_sd": "tab:blue", "ar": "tab:gray", "auto": "tab:green"}
PARTS = [("prefix", "target prefix", "tab:purple"), ("suffix", "target suffix / verify", "tab:blue"),
         ("rollout_wait", "branch rollout past the suffix", "tab:red"),
         ("draft", "serial draft (sd window; mirror first + fallback windows)", "tab:orange"),
         ("overhead", "overhead", "tab:gray"), ("unsplit", "mlx-lm step (not split)", "tab:cyan")]


def _f(x: Optional[float], fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def _pct(x: Optional[float]) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def label(mode: str, report: dict) -> str:
    """A table row's name: the mode, the draft it ran with, its knobs and placement (mlx_sd: its k)."""
    if mode == "ar":
        return "ar"
    ran = report.get("ran", {}).get(mode, {})
    knobs = ran.get("knobs", "")
    if mode != "mlx_sd" and knobs.startswith(mode):
        knobs = knobs[len(mode):].strip()
    inner = ", ".join(x for x in (knobs, "cores split" if ran.get("placement") == "split" else "") if x)
    return f"{mode} [{report.get('draft', 'draft')}]" + (f" ({inner})" if inner else "")


def mode_table(rows: dict, report: dict) -> list[str]:
    lines = ["| mode | tok/s | × ar | × ar (paired) | × mlx_sd | × mlx_sd (paired) | accepted / target fwd | ms / step "
             "| fallback | reuse | Ω_κ | hidden draft | peak GB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, r in rows.items():
        if report.get("ran"):
            name = label(mode, report)
        else:
            name = mode + (f" (k={','.join(map(str, r['num_draft_tokens']))})" if r.get("num_draft_tokens") else "")
        if r.get("ran_as"):
            name += f" [ran as {','.join(r['ran_as'])}]"
        lines.append(f"| {name} | {r['tokens_per_s']:.2f} | {_f(r['speedup_vs_ar'])} "
                     f"| {_f(r.get('paired_speedup_vs_ar'))} | {_f(r['speedup_vs_mlx_sd'])} "
                     f"| {_f(r.get('paired_speedup_vs_mlx_sd'))} "
                     f"| {r['mean_accepted']:.2f} | {r['ms_per_step']:.0f} | {_pct(r['fallback_rate'])} "
                     f"| {_pct(r['reuse_rate'])} | {_f(r['omega_kappa'])} | {_pct(r['hidden_draft_fraction'])} "
                     f"| {r['peak_memory_gb']:.3f} |")
    return lines


def breakdown_table(rows: dict, report: dict) -> list[str]:
    lines = ["| mode | target prefix | target suffix / verify | rollout past suffix | serial draft | ring "
             "| Python and scheduling | (draft hidden) | mlx-lm step (not split) | ideal (Eq. 10) | step / ideal |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, r in rows.items():
        b = r["breakdown_ms"]
        cells = [_f(b.get(k), "{:.1f}") for k in ("prefix", "suffix", "rollout_wait", "draft", "ring", "overhead",
                                                    "draft_hidden", "unsplit", "ideal")]
        cells.append(_f(r["ms_per_step"] / b["ideal"]) if b.get("ideal") else "–")
        name = label(mode, report) if report.get("ran") else mode
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def markdown(report: dict) -> str:
    c, m = report["config"], report["machine"]
    out = [f"# mirror-mlx bench: {c['prompts']}, temperature {c['temp']}", "",
           f"- target `{c['model'] or 'demo stories260K'}` ({report.get('target_layers')} layers), "
           f"draft `{c['draft_model'] or 'demo llama2xs'}`",
           f"- {len(report.get('prompts', []))} prompts (skip {c['skip']}), {c['max_tokens']} new tokens each, "
           f"seed {c['seed']}; {sum(p['truncated'] for p in report.get('prompts', []))} prompts cut to fit the "
           f"target's context",
           f"- machine: {m['cpu']}, {m['cpus']} CPUs, load average {_load(m.get('loadavg_start'))} → "
           f"{_load(m.get('loadavg_end'))}; {m['blas']}; OPENBLAS_NUM_THREADS={m['OPENBLAS_NUM_THREADS']}",
           f"- versions: mlx {m['mlx']}, mlx-lm {m['mlx_lm']}, mirror-mlx {m['mirror_mlx']} ({m['commit']}), "
           f"python {m['python']}",
           f"- pinning: {report.get('pinning')}",
           "- greedy tokens checked equal to mlx-lm generate_step: "
           f"{'yes' if report.get('equality_checked') else 'no (sampling)'}",
           f"- wall time {report['wall_s']:.0f} s", ""]
    if report.get("grid"):
        best = report.get("best", {})
        out += [f"Sweep over κ × γ × ℓ_e (mirror mode); best: **{best.get('name')}** "
                f"({_f(best.get('tokens_per_s'))} tok/s, {_f(best.get('speedup_vs_ar'))}× ar).", ""]
        out += sweep_table(report)
        return "\n".join(out) + "\n"
    k = report["knobs"]
    if k.get("kappa") is not None or k.get("gamma") is not None:
        out.append(f"Knobs given: κ={k['kappa']}, γ={k['gamma']}, ℓ_e={k['exit_layer']}.")
    for mode, ran in report.get("ran", {}).items():
        if mode not in ("ar", "mlx_sd"):
            out.append(f"- {mode}: {ran['knobs']} ({ran.get('why', '')}); placement {ran.get('placement_why', '')}")
    out.append("× ar and × mlx_sd are ratios of the median tokens/s; (paired) is the median over prompts of "
               "the ratio on the same prompt, run next to each other, which drift on a shared machine moves less.")
    sd = report.get("mlx_sd_sweep")
    if sd:
        tps = ", ".join(f"k={kk}: {v:.2f}" for kk, v in sd["tokens_per_s"].items())
        out.append(f"mlx_sd num_draft_tokens chosen on the first {sd['prompts']} prompts: best k={sd['best_k']} "
                   f"(median tok/s {tps}).")
    out.append("")
    for cat, rows in report["summary"].items():
        out += [f"## {cat}", ""] + mode_table(rows, report) + [""]
    out += ["## Latency per step (ms, all prompts)", "",
            "A step is one target forward; the columns before (draft hidden) add up to it. Mirror: the "
            "target's prefix, then its suffix while the draft rolls out every branch (the hidden part); a "
            "rollout that outlasts the suffix makes the target wait, and after a fallback the draft writes "
            "a fresh window while the target waits (serial draft); ring: the answers' way back over the ring "
            "and the scheduler's wake-up, beyond the draft's own time. sd: the draft's window, then the "
            "target's verify forward. ar's accepted count is below 1 because mlx-lm runs one look-ahead "
            "forward. Ideal (Eq. 10): per mirror step prefix + max(suffix, rollout) with the durations "
            "measured in this run, plus the serial fallback windows; step / ideal is what the scheduler, "
            "the ring and the target's waits add.", ""]
    out += breakdown_table(report["summary"]["all"], report) + [""]
    if report.get("decompose"):
        out += ["## Eq. 10 from the pieces timed alone", ""] + decompose_table(report) + [""]
    return "\n".join(out) + "\n"


def sweep_table(report: dict) -> list[str]:
    rows = report["summary"]["all"]
    lines = ["| κ | γ | ℓ_e | tok/s | × ar | × ar (paired) | accepted / target fwd | ms / step | fallback "
             "| hidden draft | Ω_κ |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for pt in report["points"]:
        r = rows[point_name(pt)]
        lines.append(f"| {pt['kappa']} | {pt['gamma']} | {pt['exit_layer']} | {r['tokens_per_s']:.2f} "
                     f"| {_f(r['speedup_vs_ar'])} | {_f(r.get('paired_speedup_vs_ar'))} | {r['mean_accepted']:.2f} "
                     f"| {r['ms_per_step']:.0f} "
                     f"| {_pct(r['fallback_rate'])} | {_pct(r['hidden_draft_fraction'])} | {_f(r['omega_kappa'])} |")
    ar = rows.get("ar")
    if ar:
        lines += ["", f"ar (mlx-lm generate_step): {ar['tokens_per_s']:.2f} tok/s."]
    return lines


def _load(x) -> str:
    return "?" if not x else "/".join(f"{v:.1f}" for v in x)


# --- plots -------------------------------------------------------------------------------------------

def save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_speedup(report: dict, path: Path) -> None:
    """Speedup over ar per category, one bar per mode."""
    summary = report["summary"]
    cats = list(summary)
    modes = [m for m in report["modes"] if m != "ar"]
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(cats) * max(1, len(modes)) / 2 + 2), 3.8))
    w = 0.8 / max(1, len(modes))
    for j, mode in enumerate(modes):
        vals = [summary[c].get(mode, {}).get("speedup_vs_ar") or 0 for c in cats]
        xs = [i + (j - (len(modes) - 1) / 2) * w for i in range(len(cats))]
        bars = ax.bar(xs, vals, w, label=mode, color=COLORS.get(mode))
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8)
    tilted = len(cats) > 3
    ax.set_xticks(range(len(cats)), cats, rotation=30 if tilted else 0, ha="right" if tilted else "center")
    ax.set_ylabel("tokens/s ÷ ar (mlx-lm generate_step)")
    ax.set_title(f"Speedup over ar — {report['config']['prompts']}, T={report['config']['temp']}")
    ax.legend(fontsize=8)
    save(fig, path)


def plot_accepted(report: dict, path: Path) -> None:
    """Mean tokens committed per target forward (correction token included), per mode."""
    rows = report["summary"]["all"]
    modes = list(rows)
    vals = [rows[m]["mean_accepted"] for m in modes]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    bars = ax.bar(modes, vals, color=[COLORS.get(m) for m in modes])
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_ylabel("tokens per target forward")
    ax.set_title(f"Accepted tokens per step — {report['config']['prompts']}, T={report['config']['temp']}")
    save(fig, path)


def plot_latency(report: dict, path: Path) -> None:
    """Stacked ms per step: target prefix / suffix / draft not hidden / overhead (mlx-lm loops: one bar)."""
    rows = report["summary"]["all"]
    modes = list(rows)
    fig, ax = plt.subplots(figsize=(6.5, 0.7 * len(modes) + 2.4))
    used = set()
    for i, mode in enumerate(modes):
        b, left = rows[mode]["breakdown_ms"], 0.0
        for key, label, color in PARTS:
            v = b.get(key)
            if v:
                ax.barh(i, v, left=left, color=color, label=label if key not in used else None)
                used.add(key)
                left += v
        hidden = b.get("draft_hidden")
        if hidden:
            ax.barh(i - 0.32, hidden, height=0.15, left=b["prefix"], color="tab:green",
                    label="draft hidden in suffix" if "hidden" not in used else None)
            used.add("hidden")
        ax.text(left, i, f" {left:.0f} ms / {rows[mode]['mean_accepted']:.2f} tok", va="center", fontsize=8)
    ax.set_yticks(range(len(modes)), modes)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (one target forward)")
    ax.set_title(f"Latency per step — {report['config']['prompts']}, T={report['config']['temp']}")
    ax.set_xlim(0, ax.get_xlim()[1] * 1.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False)
    save(fig, path)


def plot_timeline(report: dict, path: Path, steps: int = 10) -> bool:
    """The first mirror steps of the first prompt: target and draft lanes, so overlap is visible."""
    sample = next((s for s in report["samples"] if s["mode"] == "mirror" and s["stats"]["timeline"]), None)
    if sample is None:
        return False
    fig, ax = plt.subplots(figsize=(9, 2.4))
    for step in sample["stats"]["timeline"][:steps]:
        for key, lane, color in (("prefix", 1, "tab:purple"), ("suffix", 1, "tab:blue"), ("rollout", 0, "tab:orange")):
            a, b = step[key]
            ax.barh(lane, 1000 * (b - a), left=1000 * a, color=color, edgecolor="white", height=0.6)
        ax.text(1000 * step["suffix"][1], 1.35, f"A={step['accepted']}", fontsize=6)
    ax.set_yticks([0, 1], ["draft (branch rollout)", "target (prefix | suffix)"])
    ax.set_xlabel("ms since the first step")
    ax.set_title(f"Mirror-SD timeline, prompt #{sample['prompt']} "
                 f"(first {steps} steps; gaps: fallback windows, verify)")
    save(fig, path)
    return True


def plot_sweep(report: dict, path: Path) -> None:
    """Heat map of speedup over ar: κ × γ, one panel per exit layer."""
    rows, grid = report["summary"]["all"], report["grid"]
    exits = grid["exit"]
    fig, axes = plt.subplots(1, len(exits), figsize=(3.4 * len(exits) + 0.8, 3.2), squeeze=False)
    vals = {e: [[rows[f"k{k}-g{g}-e{e}"]["speedup_vs_ar"] or 0 for k in grid["kappa"]] for g in grid["gamma"]]
            for e in exits}
    hi = max(max(max(r) for r in v) for v in vals.values())
    for ax, e in zip(axes[0], exits):
        im = ax.imshow(vals[e], cmap="RdYlGn", vmin=0, vmax=max(2.0, hi), origin="lower", aspect="auto")
        for gi, row in enumerate(vals[e]):
            for ki, v in enumerate(row):
                ax.text(ki, gi, f"{v:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(grid["kappa"])), grid["kappa"])
        ax.set_yticks(range(len(grid["gamma"])), grid["gamma"])
        ax.set_xlabel("κ")
        ax.set_ylabel("γ")
        ax.set_title(f"ℓ_e = {e}")
    fig.colorbar(im, ax=axes[0].tolist(), label="tokens/s ÷ ar")
    fig.suptitle(f"Mirror-SD sweep — {report['config']['prompts']}, T={report['config']['temp']}", fontsize=10, y=1.04)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def write_report(report: dict, out: Path) -> list[Path]:
    """results.md and the plots; returns the files written."""
    out = Path(out)
    files = [out / "results.md"]
    files[0].write_text(markdown(report))
    if report.get("grid"):
        plot_sweep(report, out / "sweep_heatmap.png")
        return files + [out / "sweep_heatmap.png"]
    plot_speedup(report, out / "speedup.png")
    plot_accepted(report, out / "accepted.png")
    plot_latency(report, out / "latency.png")
    files += [out / "speedup.png", out / "accepted.png", out / "latency.png"]
    if plot_timeline(report, out / "timeline.png"):
        files.append(out / "timeline.png")
    return files
