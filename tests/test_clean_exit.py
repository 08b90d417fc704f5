"""A script that generates and returns exits 0: no SIGABRT at interpreter exit.

MLX's per-thread state (the `mx.compile` cache) is destroyed when its OS thread ends, and that
destructor takes the GIL; a thread that ends while the interpreter finalizes is stopped inside it and
the process aborts ("terminate called without an active exception", exit status 134). The library's
MLX threads (the target's worker, an in-process draft host) therefore never end before the process
does (mirror_mlx/engine/workers.py). The abort is a race at exit, so each run is a fresh process.
"""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

RUNS = 20

# mlx-lm's API with an in-process draft: two library threads compute with MLX here (the target's
# worker and the draft host's), each running compiled functions (mlx-lm's activations and samplers).
# The script never closes anything, as a user's script would not.
SCRIPT = """
from mlx_lm import load
import mirror_mlx
from mirror_mlx import demo as demo_pair

model, tokenizer = load(str(demo_pair.TARGET))
draft, _ = load(str(demo_pair.DRAFT))
for mode in ("mirror", "sd", "auto"):
    text = mirror_mlx.generate(model, tokenizer, "Once upon a time", max_tokens=3, draft_model=draft, mode=mode)
    assert text, mode
print("generated")
"""


@pytest.mark.timeout(1200)  # twenty processes in turn, on a loaded box
def test_a_script_that_generates_in_every_mode_and_returns_exits_0_twenty_times(tmp_path, tuning_cache):
    script = tmp_path / "generate_and_return.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)  # MIRROR_MLX_CACHE: the session's, so auto's profile is calibrated once

    def run(_):
        return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)

    runs = [run(0)]  # the first calibrates auto's profile for the pair; the others read it
    with ThreadPoolExecutor(2) as pool:
        runs += list(pool.map(run, range(RUNS - 1)))
    failed = [(r.returncode, r.stderr.strip()[-300:]) for r in runs if r.returncode != 0 or "generated" not in r.stdout]
    assert not failed, f"{len(failed)} of {RUNS} runs failed (exit status, stderr's end): {failed[:3]}"
