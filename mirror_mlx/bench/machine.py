"""What a benchmark's numbers depend on: the machine, and where its threads ran (Linux /proc pinning)."""

import os
import platform
import re
import subprocess
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx_lm

from .. import __version__
from ..blas import status
from ..tune.placement import hold
from ..tune.profile import cpu_name

if TYPE_CHECKING:
    from ..pipeline import Pipeline


def machine() -> dict:
    """What the numbers depend on: CPU, cores, load, versions, BLAS threads."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except Exception:
        commit = ""
    return {"platform": platform.platform(), "cpu": cpu_name(), "cpus": os.cpu_count(),
            "cpus_allowed": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "python": platform.python_version(),
            "mlx": mx.__version__,  # type: ignore[attr-defined]  # (mlx's stub leaves it out)
            "mlx_lm": mlx_lm.__version__,
            "mirror_mlx": __version__, "commit": commit, "blas": status(),
            "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
            "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None}


def _tids() -> list[int]:
    return sorted(int(t) for t in os.listdir("/proc/self/task"))


def pin_threads(pipe: "Pipeline") -> dict:
    """The Mac analog, a labelled bench setting: target side (and mlx-lm baselines) on one core in every
    mode, the draft host on another. The pipeline's own core placement (tune/placement.py) is then held:
    stats.placement says "held by the caller".

    MLX starts one CPU thread per stream on its first task, from the thread that submits it, and a
    new thread inherits its creator's affinity. So: pin every thread alive now (main, the default
    stream, the target worker) to core A, then every thread of the draft host's process (or its one
    thread, for an in-process draft) to core B. With OPENBLAS_NUM_THREADS=1 no other compute threads
    exist. `thread_report` shows afterwards where this process's CPU time went.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {"pinned": False, "why": f"only {len(cpus)} CPU allowed"}
    a, b = cpus[0], cpus[1]
    for tid in _tids():
        os.sched_setaffinity(tid, {a})
    out = {"pinned": True, "target_cpu": a, "draft_cpu": b, "main_tid": threading.get_native_id(),
           "target_worker_tid": pipe.engine.on_target(threading.get_native_id)}
    if pipe.engine.has_draft:  # the draft host: every thread of its process (or its one thread)
        tids = pipe.engine.draft_threads
        for tid in tids:
            os.sched_setaffinity(tid, {b})
        out["draft_host_tids"] = tids

    hold(pipe, f"Mac analog: target side on core {a} in every mode, draft host on core {b}")
    return out


def thread_report() -> list[dict]:
    """Every thread of this process: allowed CPUs and CPU seconds used."""
    out, tick = [], os.sysconf("SC_CLK_TCK")
    for tid in _tids():
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            status = Path(f"/proc/self/task/{tid}/status").read_text()
        except OSError:
            continue
        allowed = re.search(r"Cpus_allowed_list:\s*(\S+)", status)
        out.append({"tid": tid, "cpus": allowed.group(1) if allowed else "?",
                    "cpu_s": round((int(stat[11]) + int(stat[12])) / tick, 2)})
    return out
