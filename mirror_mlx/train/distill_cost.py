"""The distilled draft's cost: its 1-row forward against the target's, one core each, in a fresh process
(mirror_mlx/train/distill.py's measurement)."""

import json
import os
import shutil
import subprocess
import sys

_COST_SCRIPT = r"""
import json, sys, time
import mirror_mlx  # the BLAS preload, before mlx.core
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mirror_mlx.drafts.distilled.model_types import load_model  # mlx-lm's, with our model types
from pathlib import Path

def timer(model, context):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, context), mx.int32), cache=cache))
    y = mx.zeros((1, 1), mx.int32)
    def run(reps):
        t = time.perf_counter()
        for _ in range(reps):
            mx.eval(model(y, cache=cache))
            for c in cache:
                c.trim(1)
        return (time.perf_counter() - t) / reps * 1000
    run(3)
    return run

a = json.loads(sys.argv[1])
mx.set_default_device(mx.cpu)
target = timer(load_model(Path(a["target"]))[0], a["context"])
draft = timer(load_model(Path(a["draft"]))[0], a["context"])
t, d = [], []
for _ in range(a["rounds"]):  # interleaved; the fastest round of each is the least disturbed
    t.append(target(a["reps"]))
    d.append(draft(a["reps"] * 3))
print(json.dumps({"target_ms": min(t), "draft_ms": min(d)}))
"""


def cost_ratio(target: str, draft: str, context: int = 256, reps: int = 10, core: int = 0, rounds: int = 7) -> dict:
    """c: the draft's 1-row forward (KV cache of `context` tokens, float32) over the target's, each run
    on one core (OPENBLAS_NUM_THREADS=1, pinned with taskset where there is one), in a fresh process."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-c", _COST_SCRIPT, json.dumps({"target": str(target), "draft": str(draft),
                                                           "context": context, "reps": reps,
                                                           "rounds": rounds})]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", str(core)] + cmd
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"cost measurement failed: {done.stderr.strip().splitlines()[-1:]}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    r["c"] = r["draft_ms"] / r["target_ms"]
    return r
