"""Our sd against mlx-lm's speculative decoding at equal window (γ = k), on the demo's widened pair.

Both draft with the same Speculative-Streaming draft (mlx-lm drives its main rows), on one prompt,
interleaved, three rounds; prints the median tok/s of each and their ratio per window. Run `make demo`
first (it builds the widened pair into build/).

    .venv/bin/python scripts/sd_vs_mlx_sd.py --prompt "Once upon a time"
"""

import argparse
import statistics
from pathlib import Path

from mirror_mlx.drafts.ss.model import load_ss_draft
from mirror_mlx.bench.baselines import run_mlx_sd
from mirror_mlx.pipeline import load

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--windows", default="2,3,4,5")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--build", type=Path, default=ROOT / "build")
    args = ap.parse_args()
    b = args.build
    adapters = ",".join(str(b / f"stories-98M-exit{i}.safetensors") for i in (1, 2, 3))
    pipe = load(b / "stories-98M", b / "ss-8M", exit_adapter=adapters)
    main_stream, _ = load_ss_draft(b / "ss-8M", with_tokenizer=False)
    ids = pipe.encode(args.prompt)
    windows = [int(g) for g in args.windows.split(",")]
    ours: dict[int, list[float]] = {g: [] for g in windows}
    theirs: dict[int, list[float]] = {g: [] for g in windows}
    try:
        for _ in range(args.rounds):
            for g in windows:
                r = pipe.generate(args.prompt, max_tokens=args.max_tokens, mode="sd", gamma=g, stop=False)
                m = run_mlx_sd(pipe.model, main_stream, ids, args.max_tokens, g)
                assert r.tokens == m.tokens[: len(r.tokens)], f"γ={g}: the two texts differ"
                ours[g].append(r.stats.tokens_per_second)
                theirs[g].append(m.tokens_per_s)
    finally:
        pipe.close()
    for g in windows:
        a, m = statistics.median(ours[g]), statistics.median(theirs[g])
        print(f"γ = k = {g}: sd {a:.1f} tok/s | mlx_sd {m:.1f} tok/s | {a / m:.2f}x")


if __name__ == "__main__":
    main()
