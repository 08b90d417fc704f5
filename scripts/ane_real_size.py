"""The ANE draft at real size: convert, verify, lut4 and lut6 figures of a Qwen3-0.6B-shaped draft.

    .venv/bin/python scripts/ane_real_size.py [--layers 28] [--work /tmp/ane-real] [--keep]

Builds a random-weight Qwen3-0.6B-shaped folder (tests/qwen3_shape.py: mlx-lm's own classes and
save_model, bf16, a synthetic 151,669-token WordLevel tokenizer), then runs each phase as its own
`mirror-mlx convert` process under /usr/bin/time, one at a time: fp16 build, `--verify`, lut4
and lut6 builds, `--verify` of the lut4 package. Prints a markdown table (wall and CPU seconds,
peak RSS, package size, the verdict) and the load average: on a shared machine wall time follows
the load, CPU time much less. Packages are deleted at the end unless --keep (0.3-1.2 GB each).
"""

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "mirror_mlx", "convert"]


def measured(cmd: list[str], log: Path) -> dict:
    """Run `cmd` under /usr/bin/time: wall and CPU seconds, peak RSS (GB), its last output line."""
    stats = log.with_suffix(".time")
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.call(["/usr/bin/time", "-f", "%e %U %S %M", "-o", str(stats)] + cmd,
                             stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    wall, user, sys_, rss = stats.read_text().split()[-4:]
    lines = [ln for ln in log.read_text().replace("\r", "\n").splitlines() if ln.strip()]
    return dict(rc=rc, wall=float(wall), cpu=float(user) + float(sys_), rss=int(rss) / 1e6,
                last=lines[-1] if lines else "", elapsed=time.monotonic() - t0)


def size_gb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ane-real"))
    ap.add_argument("--keep", action="store_true", help="keep the draft folder and the packages")
    ap.add_argument("--skip-lut", action="store_true", help="fp16 build and verify only")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from qwen3_shape import qwen3_draft

    args.work.mkdir(parents=True, exist_ok=True)
    draft = args.work / f"qwen3-{args.layers}L"
    if not (draft / "config.json").is_file():
        qwen3_draft(draft, args.layers)
    fp16 = args.work / f"qwen3-{args.layers}L.mlpackage"
    luts = [] if args.skip_lut else ["lut4", "lut6"]
    packages = {q: args.work / f"qwen3-{args.layers}L-{q}.mlpackage" for q in luts}
    rows = []
    try:
        r = measured(CLI + ["--draft-model", str(draft), "--out", str(fp16)], args.work / "convert.log")
        rows.append(("convert fp16", r, size_gb(fp16)))
        r = measured(CLI + ["--verify", str(fp16), "--draft-model", str(draft)], args.work / "verify.log")
        rows.append(("convert --verify", r, None))
        for q, pkg in packages.items():
            r = measured(CLI + ["--draft-model", str(draft), "--out", str(pkg), "--quantize", q],
                         args.work / f"{q}.log")
            rows.append((f"convert --quantize {q}", r, size_gb(pkg)))
        if "lut4" in packages:
            r = measured(CLI + ["--verify", str(packages["lut4"]), "--draft-model", str(draft)],
                         args.work / "verify-lut4.log")
            rows.append(("convert --verify (lut4 package)", r, None))
    finally:
        if not args.keep:
            for p in (fp16, *packages.values(), draft):
                shutil.rmtree(p, ignore_errors=True)
    print(f"\n{args.layers}-layer Qwen3-0.6B-shaped draft; load average {open('/proc/loadavg').read().split()[:3]}, "
          f"{os.cpu_count()} cores\n")
    print("| phase | wall | CPU | peak RSS | package | exit | last line |")
    print("|---|---|---|---|---|---|---|")
    for name, r, size in rows:
        pkg = "" if size is None else f"{size:.2f} GB"
        print(f"| {name} | {r['wall']:.0f} s | {r['cpu']:.0f} s | {r['rss']:.1f} GB | {pkg} | {r['rc']} | {r['last'][:160]} |")
    for name, r, _ in rows:
        if name.startswith("convert --quantize"):
            print(f"\n{name.split()[-1]} build / fp16 build: wall {r['wall'] / rows[0][1]['wall']:.2f}x, "
                  f"CPU {r['cpu'] / rows[0][1]['cpu']:.2f}x")


if __name__ == "__main__":
    main()
