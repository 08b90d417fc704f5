"""`make demo`: the demo pair made cost-realistic, generated with mode="auto", and one comparison line.

The embedded pair is tiny (a 260K-parameter target), so speculation cannot pay off on it. `widen`
makes a copy that computes exactly the same logits at a realistic cost (98M target, 8M draft) into
build/. mode="auto" then calibrates it on first use (one line on stderr; the profile is cached) and
the same prompt runs in ar, sd, mirror (each at its best knobs in the profile) and auto. Every mode
must give the same text: that is checked and printed too.
"""

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "mirror_mlx" / "demo"
WIDE = {  # as scripts/bench.sh: the bench's widened pair
    "stories-98M": (DEMO / "stories260K", dict(hidden=768, heads=96, kv_heads=48, intermediate=2064, layers=15)),
    "llama2xs-8M": (DEMO / "llama2xs", dict(hidden=256, heads=32, kv_heads=16, intermediate=768, layers=10)),
}


def widened(build: Path) -> tuple[Path, Path]:
    from mirror_mlx.convert.widen import widen

    out = []
    for name, (src, size) in WIDE.items():
        path = build / name
        if not (path / "model.safetensors").exists():
            print(f"demo: widening {src.name} -> {path} (same logits, realistic cost)", file=sys.stderr)
            widen(src, path, size["hidden"], size["heads"], size["intermediate"], size["layers"], size["kv_heads"])
        out.append(path)
    return out[0], out[1]


def best_knobs(profile, mode: str) -> dict:
    """The fastest measured (else predicted) point of `mode` in the profile's table."""
    rows = [r for r in profile.table if r["mode"] == mode]
    if not rows:
        return {}
    r = max(rows, key=lambda r: (r["measured"] is not None, r["measured"] or r["predicted"]))
    return {k: r[k] for k in ("kappa", "gamma", "exit_layer") if r[k] is not None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--build", type=Path, default=ROOT / "build")
    args = ap.parse_args()

    from mirror_mlx import tune
    from mirror_mlx.pipeline import load

    t0 = time.perf_counter()
    target, draft = widened(args.build)
    pipe = load(target, draft)
    try:
        auto = pipe.generate(args.prompt, max_tokens=args.max_tokens)  # calibrates on first use
        print(args.prompt + auto.text)
        profile = tune.profile_for(pipe)
        results = {}
        for mode in ("ar", "sd", "mirror"):  # (the calibration ran every mode: all are warm, auto's run too)
            knobs = best_knobs(profile, mode)
            results[mode] = (pipe.generate(args.prompt, max_tokens=args.max_tokens, mode=mode, **knobs), knobs)
    finally:
        pipe.close()
    same = all(r.tokens == auto.tokens for r, _ in results.values())
    ar = results["ar"][0].stats.tokens_per_second
    parts = [f"{mode} {r.stats.tokens_per_second:.1f} tok/s" + (f" ({' '.join(f'{k}={v}' for k, v in kn.items())})"
                                                              if kn else "") for mode, (r, kn) in results.items()]
    s = auto.stats
    parts.append(f"auto -> {tune.describe(s)} {s.tokens_per_second:.1f} tok/s ({s.tokens_per_second / ar:.2f}x ar)")
    load_avg = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "n/a"
    print(" | ".join(parts) + f" | same text: {'yes' if same else 'NO'} | load {load_avg} | "
          f"{time.perf_counter() - t0:.0f} s in all")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
