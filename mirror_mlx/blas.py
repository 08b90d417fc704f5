"""Preload Debian's OpenBLAS before MLX on Linux.

MLX's Linux CPU wheel links the slow reference BLAS. Loading OpenBLAS with RTLD_GLOBAL before
`mlx.core` makes MLX's BLAS calls resolve to it (float32 matmuls ~30x faster). Nothing changes
numerically that our tests depend on; without the library everything still works, only slower,
and `status()` says so.
"""

import ctypes
import os
import sys

OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)

_loaded: str | None = None


def preload_openblas() -> str | None:
    """Load OpenBLAS globally if present; returns its path or None. Must run before mlx.core loads."""
    global _loaded
    if _loaded or not sys.platform.startswith("linux") or os.environ.get("MIRROR_MLX_NO_OPENBLAS"):
        return _loaded
    if "mlx.core" in sys.modules and "OPENBLAS_PRELOADED" not in os.environ:
        return None  # too late: MLX already bound its BLAS
    path = next((p for p in OPENBLAS_PATHS if os.path.exists(p)), None)
    if path is not None:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        _loaded = path
    return _loaded


def status() -> str:
    """One line for logs: which BLAS MLX's CPU backend uses."""
    if not sys.platform.startswith("linux"):
        return "BLAS: platform default"
    if _loaded:
        return f"BLAS: OpenBLAS preloaded ({_loaded})"
    return "BLAS: MLX reference BLAS (slow; install libopenblas0-pthread to speed up CPU matmuls)"


def single_threaded() -> list[str]:
    """Run every OpenBLAS in this process on one thread (numpy's own and the one preloaded for
    MLX), unless OPENBLAS_NUM_THREADS is set; returns the libraries it set. For `convert --verify`:
    its products are 64-row panels, which a second thread barely speeds up on an idle machine and
    slows down badly on a busy one (threads spin waiting for a core: a 0.6B draft's verify took
    378 s of CPU with two threads against 192 s with one, on a loaded 2-core machine)."""
    if os.environ.get("OPENBLAS_NUM_THREADS"):
        return []
    return list(set_threads(1))


def keep_freed_memory() -> bool:
    """Let glibc serve blocks of up to 1 GB from its heap and keep up to 512 MB of freed heap
    instead of handing each block back to the OS: a 0.6B package's verify allocates and frees 100s
    of MB per call (KV state, logits), and every page handed back faults again on the next call (a
    fifth of verify's CPU time went to the kernel). Process-wide, so for the `convert` command's
    own process. Returns whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, 1 << 29))


_SETTERS = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads")
_GETTERS = ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads")
_initial: dict[str, int] = {}  # each OpenBLAS's thread count when first seen here: what `set_threads` caps at
_libs: list = []  # (path, library) of every OpenBLAS found, looked up once
_followed = [0]  # the core count `follow_affinity` last set threads for


def _openblas_libs() -> list[tuple[str, ctypes.CDLL]]:
    """Every OpenBLAS mapped into this process (the one preloaded for MLX, numpy's own), found once."""
    if _libs or not sys.platform.startswith("linux"):
        return _libs
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "openblas" in line and ".so" in line}
    for path in sorted(paths):
        try:
            _libs.append((path, ctypes.CDLL(path)))
        except OSError:
            continue
    return _libs


def threads() -> dict[str, int]:
    """{library: its OpenBLAS thread count now}."""
    out = {}
    for path, lib in _openblas_libs():
        get = next((getattr(lib, n) for n in _GETTERS if hasattr(lib, n)), None)
        if get is not None:
            out[path] = int(get())
            _initial.setdefault(path, out[path])
    return out


def set_threads(n: "int | dict[str, int]") -> dict[str, int]:
    """Run every OpenBLAS of this process on `n` threads at most (never above the count it started with,
    its pool's size), or each on its own count ({library: n}, as `threads()` gave); returns {library:
    threads set}. OpenBLAS reads OPENBLAS_NUM_THREADS only when it loads: this changes it at run time, for
    the core placement of a generation (tune/placement.py)."""
    out = {}
    now = threads()
    for path, lib in _openblas_libs():
        fn = next((getattr(lib, name) for name in _SETTERS if hasattr(lib, name)), None)
        if fn is None or path not in now or (isinstance(n, dict) and path not in n):
            continue
        want = max(1, min(n[path] if isinstance(n, dict) else n, _initial[path]))
        if now[path] != want:
            fn(want)
        out[path] = want
    return out


def follow_affinity() -> dict[str, int]:
    """OpenBLAS threads = the cores this thread may run on (at most the count it started with): a
    process confined to one core runs one BLAS thread, not two that take turns on it. The draft host
    calls it before each request, so the placement its parent gives it (tune/placement.py) sets both."""
    if not hasattr(os, "sched_getaffinity") or not sys.platform.startswith("linux"):
        return {}
    n = len(os.sched_getaffinity(0))
    if n == _followed[0]:
        return {}
    _followed[0] = n
    return set_threads(n)
