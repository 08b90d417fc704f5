"""How long a draft host takes to start: from `DraftHost(recipe)` to its READY, median of N starts.

    .venv/bin/python scripts/benchmarks/host_start.py [N] [--imports]

For the demo pair's plain draft (llama2xs) and its SS draft, each in its own process as `load` starts
them. Wall time moves with the machine's load, so each start's CPU time (the host process's user + system
seconds, from its own start to its exit) is printed too: that holds on a shared machine. `--imports` also
prints the host process's slowest imports (python -X importtime) once.
"""

import os
import resource
import statistics
import subprocess
import sys
import time

from mirror_mlx.drafts.host import DraftHost

from mirror_mlx.drafts.recipes import DraftRecipe, mlx_draft, ss_draft
from mirror_mlx.demo import DRAFT, SS_DRAFT


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def start_once(recipe: DraftRecipe) -> tuple[float, float]:
    """(wall seconds to READY, the host process's CPU seconds in all: its start, READY, and its exit)."""
    cpu, t0 = children_cpu(), time.perf_counter()
    host = DraftHost(recipe)
    dt = time.perf_counter() - t0
    host.close()
    return dt, children_cpu() - cpu


def slowest_imports(recipe: DraftRecipe, top: int = 12) -> str:
    """The host process's imports by cumulative time, from one start under -X importtime."""
    env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1")
    code = ("import sys; from mirror_mlx.drafts.host_process import without_tokenizers; without_tokenizers(); "
            "import mirror_mlx; from mirror_mlx.drafts import host; "
            f"host.{recipe.build.__name__}({str(recipe.args[0])!r})")
    err = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stderr
    rows = [line.split("|") for line in err.splitlines() if line.startswith("import time:") and "cumulative" not in line]
    rows = sorted(((int(r[1]), r[2].rstrip()) for r in rows), reverse=True)[:top]
    return "\n".join(f"  {us / 1000:7.1f} ms {name}" for us, name in rows)


def main() -> None:
    n = int(next((a for a in sys.argv[1:] if a.isdigit()), 20))
    for recipe in (DraftRecipe(mlx_draft, (str(DRAFT),)), DraftRecipe(ss_draft, (str(SS_DRAFT),))):
        start_once(recipe)  # the page cache warm, as in a test run
        runs = [start_once(recipe) for _ in range(n)]
        times, cpus = [w for w, _ in runs], [c for _, c in runs]
        print(f"{recipe.build.__name__}: median {statistics.median(times):.3f} s, min {min(times):.3f} s, "
              f"max {max(times):.3f} s over {n} starts; CPU median {statistics.median(cpus):.3f} s "
              f"(load average {os.getloadavg()[0]:.1f})")
        if "--imports" in sys.argv:
            print(slowest_imports(recipe))


if __name__ == "__main__":
    main()
