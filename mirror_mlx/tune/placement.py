"""Core placement, the product's own choice per mode (docs/design.md §4, "Placement").

"unpinned" touches nothing (ar and sd always run so: every core serves their one model at a time); "split",
for mirror, pins the draft host's process to the last allowed core and this process (the target side) to the
others, each with as many OpenBLAS threads as it has cores, so the suffix and the branch rollout truly run at
once. `tune` records the faster per row (row["placement"]); a split lasts one generation, after which every
thread gets its cores back. A caller that pins threads itself sets `hold`, and placement leaves them alone.
"""

import os
import sys
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Iterator, Optional

from .. import blas
from . import profile as profiles
from .profile import PairView

if TYPE_CHECKING:
    from ..options import DecodeOptions

def split_unavailable() -> str:
    """Why this machine cannot split (not Linux, fewer than two allowed cores), or ""."""
    if not sys.platform.startswith("linux") or not hasattr(os, "sched_setaffinity"):
        return "core placement is Linux-only (a Mac runs the draft on its own engine)"
    n = len(os.sched_getaffinity(0))
    return "" if n >= 2 else f"only {n} core allowed"


def candidates(pipe: PairView) -> tuple[str, ...]:
    """The placements `tune` measures for mirror here: both, unless split is unavailable or held."""
    if pipe.auto.placement_held or split_unavailable() or pipe.engine.draft_pid is None:
        return ("unpinned",)
    return ("unpinned", "split")


def _profile(pipe: PairView) -> Optional[profiles.Profile]:
    """The pair's profile if this process has one or the cache holds one (never calibrates for placement)."""
    if pipe.auto.profile is not None:
        return pipe.auto.profile
    try:
        prof = profiles.saved(profiles.pipe_key(pipe), pipe.engine)
    except profiles.ProfileError:  # auto says so when it needs the profile; placement then stays unpinned
        return None
    if prof is not None:
        pipe.auto.profile = prof  # read once: the same profile auto would load
    return prof


def pick(pipe: PairView, mode: str, kappa: Optional[int], gamma: Optional[int], exit_layer: Optional[int]
           ) -> tuple[str, str]:
    """(placement, why) for one generation: a caller's hold, tune's forced one, else unpinned for ar and sd
    and mirror's row's measured winner (unpinned where no row measured one)."""
    held, forced = pipe.auto.placement_held, pipe.auto.placement_forced
    if held:
        return "held", f"held by the caller: {held}"
    if forced:
        return forced, "tune measuring it"
    if mode != "mirror":
        return "unpinned", f"{mode} uses every core"
    if why_not := split_unavailable():
        return "unpinned", why_not
    if pipe.engine.draft_pid is None:
        return "unpinned", "the draft host is not a process of its own"
    prof = _profile(pipe)
    row = next((r for r in prof.table if r["mode"] == mode and r.get("kappa") == kappa and r.get("gamma") == gamma
                and r.get("exit_layer") == exit_layer), None) if prof is not None else None
    if row is None or not row.get("placements"):
        return "unpinned", "no profile row measured a placement for this point (`mirror-mlx tune`)"
    rates = " vs ".join(f"{p} {v:.1f}" for p, v in sorted(row["placements"].items(), key=lambda kv: -kv[1]))
    return row.get("placement", "unpinned"), f"tune measured {rates} tok/s"


def _tids(pid: Optional[int] = None) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid or 'self'}/task"))
    except OSError:
        return []


def _affinities(pid: Optional[int] = None) -> dict[int, set]:
    """Each thread's allowed cores, for the threads that still run when asked (a server's connection threads
    come and go at any moment)."""
    out = {}
    for tid in _tids(pid):
        try:
            out[tid] = os.sched_getaffinity(tid)
        except OSError:  # a thread that ended meanwhile
            pass
    return out


def _set(tid: int, cpus: set) -> None:
    try:
        os.sched_setaffinity(tid, cpus)
    except OSError:  # a thread that ended meanwhile
        pass


@contextmanager
def split(pipe: PairView) -> Iterator[str]:
    """Pin for one generation (see the module docstring); yields where each side runs, and undoes it."""
    own = sorted(os.sched_getaffinity(0))
    target_cpus, draft_cpu = set(own[:-1]), own[-1]
    host_pid = pipe.engine.draft_pid
    before, host_before = _affinities(), _affinities(host_pid)
    threads_before = blas.threads()
    try:
        for tid in _tids():
            _set(tid, target_cpus)
        for tid in _tids(host_pid):
            _set(tid, {draft_cpu})  # the host sets its BLAS threads to its cores on its next request
        blas.set_threads(len(target_cpus))
        yield (f"split: target side on core{'s' if len(target_cpus) > 1 else ''} "
               f"{','.join(map(str, sorted(target_cpus)))} ({len(target_cpus)} BLAS thread"
               f"{'s' if len(target_cpus) > 1 else ''}), draft host on core {draft_cpu} (1 BLAS thread)")
    finally:
        for tid in _tids():
            _set(tid, before.get(tid, set(own)))
        for tid in _tids(host_pid):
            _set(tid, host_before.get(tid, set(own)))
        blas.set_threads(threads_before)


@contextmanager
def placed(pipe: PairView, opts: "DecodeOptions") -> Iterator["DecodeOptions"]:
    """Run one generation in its placement: yields `opts` with `placement` saying which and why."""
    name, why = pick(pipe, opts.mode, opts.kappa, opts.gamma,
                       pipe.engine.exit_layer(opts) if opts.mode == "mirror" else opts.exit_layer)
    if name != "split":
        yield replace(opts, placement=f"{name} ({why})")
        return
    with split(pipe) as where:
        yield replace(opts, placement=f"{where} ({why})")


def hold(pipe: PairView, what: str) -> None:
    """A caller pins threads itself (`what` says how): placement leaves every thread alone from now on, and
    the pair's profile is the one calibrated so (its key says how: profile.pipe_key)."""
    pipe.auto.placement_held = what
    pipe.auto.key, pipe.auto.profile = None, None
