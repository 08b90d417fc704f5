"""Shared-memory leak checks that hold on macOS too (it has no /dev/shm to look in).

A segment is looked for by name: opening it (as `SharedMemory(name=...)` does) raises FileNotFoundError
once it is unlinked. The names come from the product's own record: `host.req.ring.name`, the conftest's
`shm_made` spy in this process, or, for a subprocess, its stderr with MIRROR_MLX_TRACE_SHM set (each
TokenRing made is named there). On Linux `/proc/PID/maps` also shows every segment a process has mapped,
whoever made it (`mapped`).
"""

import os
import re
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

from mirror_mlx.drafts.ring import TRACE_ENV

_SharedMemory = shared_memory.SharedMemory  # the real class, whatever a test's spy replaces it with
_MADE = re.compile(r"mirror-mlx: shared memory made: (\S+)")

__all__ = ["TRACE_ENV", "exists", "leaked", "wait_unlinked", "made_in", "mapped"]


def exists(name: str) -> bool:
    """Whether the segment `name` can still be opened (not unlinked yet)."""
    name = name.lstrip("/")
    if sys.version_info >= (3, 13):
        try:
            _SharedMemory(name=name, track=False).close()
        except FileNotFoundError:
            return False
        return True
    # before 3.13 SharedMemory(name=...) registers the segment with this process's resource tracker, which
    # would then unlink it at exit (or complain when its maker unlinks it): open it as SharedMemory does
    import _posixshmem

    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    except FileNotFoundError:
        return False
    os.close(fd)
    return True


def leaked(names) -> list[str]:
    """Those of `names` still there."""
    return [n for n in names if exists(n)]


def wait_unlinked(names, timeout: float = 10.0) -> list[str]:
    """Those of `names` still there after up to `timeout` s (a resource tracker unlinks a dead process's
    segments once it sees it go, which takes a moment)."""
    deadline = time.monotonic() + timeout
    while (left := leaked(names)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def made_in(text: str) -> list[str]:
    """The segment names a process run with MIRROR_MLX_TRACE_SHM=1 reported in its stderr `text`."""
    return _MADE.findall(text)


def mapped(pid: int) -> set[str]:
    """The shared-memory segments process `pid` has mapped now (Linux: /proc; elsewhere empty)."""
    maps = Path(f"/proc/{pid}/maps")
    if not maps.exists():
        return set()
    return {line.split()[-1].removeprefix("/dev/shm/") for line in maps.read_text().splitlines() if "/dev/shm/" in line}
