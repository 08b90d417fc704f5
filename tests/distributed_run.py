"""Run on every rank by tests/test_distributed.py under `mlx.launch`: for each family of a spec file, one
sharded pipeline and every case; each rank's tokens are written to OUT/rank{R}.json (the test compares
them with mlx-lm's single-process tokens, and the ranks with each other).

`python tests/distributed_run.py SPEC.json OUT_DIR`; SPEC: {family: {target, draft, prompts (ids), tokens,
cases [(mode, κ, γ, ℓe, prompt index)], seeded [seed...] (T = 0.8, mode mirror, the first prompt),
unseeded (bool: one unseeded T = 0.8 sample, mode sd), pipeline (bool: the split by layers)}}.
"""

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mirror_mlx import distributed  # noqa: E402


def run_family(spec: dict) -> dict:
    pipe = distributed.load(spec["target"], spec["draft"], "none", pipeline=spec.get("pipeline", False))
    got: dict = {"greedy": [], "seeded": {}, "stats": [], "split": pipe.split}
    try:
        for mode, kappa, gamma, exit_layer, i in spec["cases"]:
            r = pipe.generate(spec["prompts"][i], max_tokens=spec["tokens"], mode=mode, kappa=kappa, gamma=gamma,
                              exit_layer=exit_layer, stop=False)
            got["greedy"].append(r.tokens)
            got["stats"].append([r.stats.mode, r.stats.draft_failure, r.stats.accepted, r.stats.fallbacks])
        for seed in spec["seeded"]:
            r = pipe.generate(spec["prompts"][0], max_tokens=spec["tokens"], mode="mirror", temperature=0.8,
                              seed=seed, stop=False)
            got["seeded"][str(seed)] = r.tokens
        if spec.get("unseeded"):  # rank 0 draws the seed: every rank must still sample the same tokens
            got["unseeded"] = pipe.generate(spec["prompts"][0], max_tokens=spec["tokens"], mode="sd",
                                            temperature=0.8, stop=False).tokens
    finally:
        pipe.close()
    return got


def reduced_bits() -> str:
    """A hash of the all_sum of arrays that differ by rank: the ranks decide alike only if it is the same."""
    import hashlib

    import mlx.core as mx

    g = distributed.group()
    x = mx.random.normal((3, 4099), key=mx.random.key(g.rank()))
    return hashlib.sha256(bytes(memoryview(mx.distributed.all_sum(x, group=g, stream=mx.cpu)))).hexdigest()


def main(spec_path: str, out: str) -> None:
    got = {"all_sum": reduced_bits()}
    for family, spec in json.loads(Path(spec_path).read_text()).items():
        t0 = time.perf_counter()
        got[family] = run_family(spec)
        got[family]["seconds"] = time.perf_counter() - t0
    Path(out, f"rank{distributed.group().rank()}.json").write_text(json.dumps(got))


if __name__ == "__main__":
    main(*sys.argv[1:])
