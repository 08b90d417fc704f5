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
    for path in OPENBLAS_PATHS:
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            _loaded = path
            break
    return _loaded


def status() -> str:
    """One line for logs: which BLAS MLX's CPU backend uses."""
    if not sys.platform.startswith("linux"):
        return "BLAS: platform default"
    if _loaded:
        return f"BLAS: OpenBLAS preloaded ({_loaded})"
    return "BLAS: MLX reference BLAS (slow; install libopenblas0-pthread to speed up CPU matmuls)"
