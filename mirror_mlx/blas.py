"""Choose and preload the BLAS that MLX's CPU backend calls on Linux.

MLX's Linux CPU wheel links the slow reference BLAS, and its matmuls call `cblas_sgemm` through the global
symbol scope: a tuned library loaded RTLD_GLOBAL before `mlx.core` takes those calls. Which library is
chosen by measurement (docs/cpu.md): Debian's OpenBLAS first, then Debian's BLIS. BLIS 0.9 runs the
decode's 1-16-row products faster on x86_64, but it crashes inside its gemm kernel on one of the suite's
runs (a LoRA target with its draft in the same process), so it is there to choose, not the default.
`MIRROR_MLX_BLAS` (`blis`, `openblas`, `none`, or a library's path) overrides the rule. A machine without
the preferred library runs on the next one, or on MLX's own, slower, and says so once.
"""

import ctypes
import logging
import os
import platform
import sys
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("mirror_mlx")


@dataclass(frozen=True)
class Library:
    """A BLAS MLX can take: where Debian installs it, and how to read and set its thread count."""

    key: str
    name: str
    package: str  # Debian's package
    path: str  # {arch} is the machine's (x86_64, aarch64)
    set_threads: tuple[str, ...]  # the setter's symbol, first found
    get_threads: tuple[str, ...]
    env: str  # its own thread variable


LIBRARIES = {
    "blis": Library("blis", "BLIS", "libblis4-openmp", "/usr/lib/{arch}-linux-gnu/blis-openmp/libblis.so.4",
                    ("bli_thread_set_num_threads",), ("bli_thread_get_num_threads",), "BLIS_NUM_THREADS"),
    "openblas": Library("openblas", "OpenBLAS", "libopenblas0-pthread",
                        "/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",
                        ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                         "openblas_set_num_threads"),
                        ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                         "openblas_get_num_threads"),
                        "OPENBLAS_NUM_THREADS"),
}
PREFERENCE = {"x86_64": ("openblas", "blis"), "aarch64": ("openblas", "blis")}
WHY = {  # the measurement behind each machine's first choice (docs/cpu.md)
    "x86_64": "the fastest library that runs every case (BLIS 0.9 is 1.1-1.3x faster at 1-16 rows but crashes on "
              "one; MIRROR_MLX_BLAS=blis chooses it)",
    "aarch64": "OpenBLAS's Neoverse kernels (BLIS 0.9 ships generic ones)",
}


@dataclass
class Loaded:
    library: Library
    path: str
    version: str
    why: str


_loaded: Optional[Loaded] = None
_said = "MIRROR_MLX_BLAS_SAID"  # set once the fallback was said, so the draft host's process stays quiet


def _arch() -> str:
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())


def choice() -> tuple[list[tuple[Library, str]], str]:
    """The libraries to try, in order, with their paths, and why that order (MIRROR_MLX_BLAS, else the rule)."""
    arch, asked = _arch(), os.environ.get("MIRROR_MLX_BLAS", "").strip()
    if os.environ.get("MIRROR_MLX_NO_OPENBLAS") or asked.lower() == "none":
        return [], "MIRROR_MLX_BLAS=none"
    if asked.lower() in LIBRARIES:
        lib = LIBRARIES[asked.lower()]
        return [(lib, lib.path.format(arch=arch))], f"MIRROR_MLX_BLAS={asked}"
    if asked:
        lib = LIBRARIES["blis"] if "blis" in os.path.basename(asked) else LIBRARIES["openblas"]
        return [(lib, asked)], f"MIRROR_MLX_BLAS={asked}"
    keys = PREFERENCE.get(arch, ("openblas", "blis"))
    return [(LIBRARIES[k], LIBRARIES[k].path.format(arch=arch)) for k in keys], WHY.get(arch, "the default order")


def preload() -> Optional[str]:
    """Load the chosen BLAS globally (before mlx.core loads); its path, or None. Idempotent."""
    global _loaded
    if _loaded or not sys.platform.startswith("linux"):
        return _loaded.path if _loaded else None
    if "mlx.core" in sys.modules:
        return None  # too late: MLX already bound its BLAS
    order, why = choice()
    for i, (lib, path) in enumerate(order):
        if not os.path.exists(path):
            continue
        try:
            handle = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            log.warning("mirror-mlx: %s at %s does not load (%s)", lib.name, path, e)
            continue
        if i > 0:
            first = order[0][0]
            why = f"{first.name}, preferred here, is not installed (apt-get install {first.package}): slower"
            _say_once(f"mirror-mlx: {first.name} is not installed; MLX runs on {lib.name}, slower "
                      f"(apt-get install {first.package}, or scripts/setup.sh, installs it)")
        _loaded = Loaded(lib, path, _version(lib, handle), why)
        _start_threads(lib, handle)
        return path
    if order and why.startswith("MIRROR_MLX_BLAS="):
        _say_once(f"mirror-mlx: {why} names no library that loads; MLX runs on its reference BLAS, ~30x slower "
                  "(name blis, openblas or an existing library's path, or unset it)")
    elif order:
        _say_once("mirror-mlx: no tuned BLAS found; MLX's CPU matmuls run on its reference BLAS, ~30x slower "
                  f"(apt-get install {order[0][0].package}, or scripts/setup.sh, installs one)")
    return None





def _say_once(message: str) -> None:
    if not os.environ.get(_said):
        os.environ[_said] = "1"
        print(message, file=sys.stderr)


def _version(lib: Library, handle: ctypes.CDLL) -> str:
    """'0.9.0 (zen3)' or '0.3.21 (Cooperlake)': the library's version and the kernels it picked."""
    try:
        if lib.key == "blis":
            handle.bli_info_get_version_str.restype = ctypes.c_char_p
            handle.bli_arch_string.restype = ctypes.c_char_p
            arch = handle.bli_arch_string(handle.bli_arch_query_id()).decode()
            return f"{handle.bli_info_get_version_str().decode()} ({arch})"
        handle.openblas_get_config.restype = ctypes.c_char_p
        handle.openblas_get_corename.restype = ctypes.c_char_p
        config = handle.openblas_get_config().decode().split()
        return f"{config[1] if len(config) > 1 else '?'} ({handle.openblas_get_corename().decode()})"
    except (AttributeError, IndexError, UnicodeDecodeError):
        return "version unknown"


def _start_threads(lib: Library, handle: ctypes.CDLL) -> None:
    """BLIS starts on one thread unless told: give it what OpenBLAS would take (its own variable, else
    OPENBLAS_NUM_THREADS, the product's knob for every library, else the cores this process may use)."""
    if lib.key != "blis" or os.environ.get(lib.env):
        return
    n = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
    count = int(n) if n and n.isdigit() else len(os.sched_getaffinity(0))
    handle.bli_thread_set_num_threads(ctypes.c_long(max(1, count)))


def status() -> str:
    """One line for logs and doctor: which BLAS MLX's CPU backend uses, and why."""
    if not sys.platform.startswith("linux"):
        return "BLAS: platform default"
    if _loaded:
        return f"BLAS: {_loaded.library.name} {_loaded.version} ({_loaded.path}): {_loaded.why}"
    order, why = choice()
    hint = f"apt-get install {order[0][0].package} to speed up CPU matmuls" if order else why
    return f"BLAS: MLX reference BLAS (slow; {hint})"


def single_threaded() -> list[str]:
    """Run every BLAS in this process on one thread (numpy's own OpenBLAS and the one preloaded for
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


_initial: dict[str, int] = {}  # each BLAS's thread count when first seen here: what `set_threads` caps at
_libs: list = []  # (path, its handle, its Library) of every BLAS found, looked up once
_followed = [0]  # the core count `follow_affinity` last set threads for


def _thread_libs() -> list[tuple[str, ctypes.CDLL, Library]]:
    """Every BLAS mapped into this process (the one preloaded for MLX, numpy's own OpenBLAS), found once."""
    if _libs or not sys.platform.startswith("linux"):
        return _libs
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if ("openblas" in line or "libblis" in line) and ".so" in line}
    for path in sorted(paths):
        try:
            _libs.append((path, ctypes.CDLL(path), LIBRARIES["blis" if "libblis" in path else "openblas"]))
        except OSError:
            continue
    return _libs


def _symbol(handle: ctypes.CDLL, names: tuple[str, ...]):
    fn = next((getattr(handle, n) for n in names if hasattr(handle, n)), None)
    if fn is not None:
        fn.restype = ctypes.c_long  # BLIS's dim_t is 64-bit; OpenBLAS's int reads the same in the low half
    return fn


def threads() -> dict[str, int]:
    """{library: its thread count now}."""
    out = {}
    for path, handle, lib in _thread_libs():
        get = _symbol(handle, lib.get_threads)
        if get is not None:
            out[path] = int(ctypes.c_int(get()).value)
            _initial.setdefault(path, out[path])
    return out


def set_threads(n: "int | dict[str, int]") -> dict[str, int]:
    """Run every BLAS of this process on `n` threads at most (never above the count it started with,
    OpenBLAS's pool's size), or each on its own count ({library: n}, as `threads()` gave); returns {library:
    threads set}. The libraries read their thread variables only when they load: this changes the count at
    run time, for the core placement of a generation (tune/placement.py)."""
    out = {}
    now = threads()
    for path, handle, lib in _thread_libs():
        fn = _symbol(handle, lib.set_threads)
        if fn is None or path not in now or (isinstance(n, dict) and path not in n):
            continue
        want = max(1, min(n[path] if isinstance(n, dict) else n, _initial[path]))
        if now[path] != want:
            fn(ctypes.c_long(want) if lib.key == "blis" else ctypes.c_int(want))
        out[path] = want
    return out


def follow_affinity() -> dict[str, int]:
    """BLAS threads = the cores this thread may run on (at most the count it started with): a
    process confined to one core runs one BLAS thread, not two that take turns on it. The draft host
    calls it before each request, so the placement its parent gives it (tune/placement.py) sets both."""
    if not hasattr(os, "sched_getaffinity") or not sys.platform.startswith("linux"):
        return {}
    n = len(os.sched_getaffinity(0))
    if n == _followed[0]:
        return {}
    _followed[0] = n
    return set_threads(n)
