"""`mirror-mlx doctor`: what this machine can do for Mirror-SD, in a few lines to paste into a bug report.

Mirror-SD pays only when the draft runs *beside* the target (docs/design.md §4), so besides the OS, chip,
Python, MLX and Core ML, the report measures that overlap: a target forward alone, a draft rollout alone (in
the draft host process, as the product runs it), and both at once. The macOS parts run only on macOS; their
parsing (`sw_vers`, `sysctl`) is plain functions of text.
"""

import contextlib
import importlib.metadata as md
import importlib.util
import io
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

import mirror_mlx

from . import __version__, blas
from .tune import compute_plan

PROBE_TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
              "One day, she saw a big red ball under a tree.")


def run_text(cmd: Sequence[str]) -> Optional[str]:
    """A command's stdout, or None if it is missing or fails (doctor reports, never raises)."""
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


# ---- the machine


def mac_lines(sw_vers: str, brand: str, model: str, translated: Optional[str], python_arch: str) -> list[str]:
    """The OS and chip lines from `sw_vers`, `sysctl -n machdep.cpu.brand_string`, `sysctl -n hw.model`
    and `sysctl -n sysctl.proc_translated` (None when the key is absent: an Intel Mac)."""
    fields = (line.partition(":") for line in sw_vers.splitlines())  # "ProductName:\tmacOS"
    v = {key.strip(): value.strip() for key, sep, value in fields if sep and value.strip()}
    brand, model = brand.strip() or "unknown chip", model.strip() or "unknown model"
    lines = [f"OS: {v.get('ProductName', 'macOS')} {v.get('ProductVersion', '?')} ({v.get('BuildVersion', '?')})",
             f"chip: {brand} ({model})"]
    apple_silicon = brand.startswith("Apple") or (translated or "").strip() == "1"
    if not apple_silicon:
        lines.append("problem: not Apple silicon: MLX's GPU backend and the Neural Engine need an M-series Mac")
    elif python_arch != "arm64":
        lines.append(f"problem: this Python is {python_arch} (under Rosetta): MLX needs a native arm64 Python "
                     "(`brew install python@3.12` on Apple silicon, or `uv python install 3.12`)")
    version = v.get("ProductVersion", "0")
    major_minor = tuple(int(x) for x in re.findall(r"\d+", version)[:2]) or (0,)
    if apple_silicon and major_minor < (14, 0):
        lines.append(f"problem: macOS {version}: MLX needs macOS 14 or later")
    return lines


def linux_cpu(cpuinfo: str) -> str:
    """The CPU's model name from /proc/cpuinfo text (x86 'model name', or Arm's 'Model'/'Hardware')."""
    for key in ("model name", "Model", "Hardware"):
        m = re.search(rf"^{key}\s*:\s*(.+)$", cpuinfo, re.M)
        if m:
            return m.group(1).strip()
    return platform.processor() or platform.machine()


def machine_lines() -> list[str]:
    if sys.platform == "darwin":
        return mac_lines(run_text(["sw_vers"]) or "", run_text(["sysctl", "-n", "machdep.cpu.brand_string"]) or "",
                         run_text(["sysctl", "-n", "hw.model"]) or "",
                         run_text(["sysctl", "-n", "sysctl.proc_translated"]), platform.machine())
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    return [f"OS: {platform.system()} {platform.release()} ({platform.machine()})",
            f"chip: {linux_cpu(cpuinfo)}, {os.cpu_count()} logical cores"]


def mlx_lines() -> list[str]:
    try:
        import mlx.core as mx  # (the report says when MLX cannot load)
    except ImportError as e:
        return [f"MLX: not importable ({e}); reinstall with `pip install -e .`"]

    line = f"MLX: {md.version('mlx')}, default device {mx.default_device()}"
    try:  # mx.device_info (MLX >= 0.30) describes the default device; older MLX has only the Metal one
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    except Exception as e:  # the rest of the report still holds
        info = {"device_name": f"no details: {type(e).__name__}"}
    name = info.get("device_name") or info.get("architecture")
    if name:
        line += f" ({name})"
    if mx.metal.is_available():
        line += f", Metal {info.get('architecture', '?')}"
        if info.get("max_recommended_working_set_size"):
            line += f", {int(info['max_recommended_working_set_size']) / 2**30:.1f} GiB recommended working set"
    else:
        line += f", no Metal GPU ({blas.status()})"
    return [line]


# ---- Core ML


def coreml_lines(package: Optional[str]) -> list[str]:
    """coremltools, whether its native runtime is here, and whether it loads and runs a package."""
    spec = importlib.util.find_spec("coremltools")  # found without importing it (seconds, and noisy off macOS)
    if spec is None or not spec.submodule_search_locations:
        extra = ("it comes with the package on macOS" if sys.platform == "darwin"
                 else "pip install 'mirror-mlx[convert]'")
        return [f"coremltools: not installed ({extra}); Core ML drafts cannot run or be built here"]
    version = md.version("coremltools")
    native = [p for d in spec.submodule_search_locations for p in Path(d).glob("libcoremlpython*")]
    if not native:  # the native Core ML bridge ships in macOS wheels only
        return [f"coremltools: {version}; native runtime: absent (Core ML runs only on macOS; here "
                "coremltools builds and --verify-checks packages)"]
    import coremltools as ct  # (coremltools: an extra off macOS)

    lines = [f"coremltools: {version}; native runtime: present"]
    try:
        t0 = time.perf_counter()
        tiny_package_runs()
        lines.append("Core ML: built, loaded and ran a one-op package on CPU_AND_NE "
                     f"in {time.perf_counter() - t0:.1f} s")
    except Exception as e:
        lines.append(f"problem: Core ML could not load and run a one-op package: {type(e).__name__}: {e}")
    if package is not None and str(package).endswith(".mlpackage"):
        try:
            t0 = time.perf_counter()
            ct.models.MLModel(str(package), compute_units=ct.ComputeUnit.CPU_AND_NE, function_name="rollout")
            lines.append(f"Core ML: loaded {package} (rollout) in {time.perf_counter() - t0:.1f} s")
        except Exception as e:
            lines.append(f"problem: Core ML could not load {package}: {type(e).__name__}: {e}")
    return lines


def tiny_package_runs() -> None:
    """Build a one-op ML program and run it (macOS): the shortest proof that Core ML works here."""
    import coremltools as ct  # (coremltools: an extra off macOS)
    from coremltools.converters.mil import Builder as mb  # (coremltools: an extra off macOS)

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 4))], opset_version=ct.target.macOS14)
    def prog(x):
        return mb.add(x=x, y=1.0)

    with contextlib.redirect_stderr(io.StringIO()):  # the converter's progress bars
        model = ct.convert(prog, convert_to="mlprogram", compute_units=ct.ComputeUnit.CPU_AND_NE,
                           minimum_deployment_target=ct.target.macOS14)
    out = next(iter(model.predict({"x": np.zeros((1, 4), np.float32)}).values()))
    if not np.allclose(out, 1.0):
        raise RuntimeError(f"x + 1 at x = 0 gave {out}")


def compute_plan_lines(package: Optional[str]) -> list[str]:
    if package is None:
        return ["Core ML compute plan: skipped (give --draft-model DRAFT.mlpackage to see where its ops run)"]
    if not str(package).endswith(".mlpackage"):
        return [f"Core ML compute plan: skipped ({package} is an MLX draft, not a Core ML package)"]
    try:
        return compute_plan.report(package).splitlines()
    except Exception as e:
        return [f"problem: Core ML compute plan of {package} failed: {type(e).__name__}: {e}"]


# ---- the overlap probe


def probe_overlap(pipe, seconds: float = 2.0, kappa: int = 4, gamma: int = 3,
                  min_rounds: int = 5) -> tuple[dict[str, float], int]:
    """Time a target forward over γ+1 rows (on the target's worker thread, in this process) and a κ(γ+1)-row
    draft rollout (in the draft host, its own process) apart and together, in interleaved rounds so a burst
    of other load hits all three alike: their medians and the number of rounds."""
    import mlx.core as mx  # (MLX: the report says when it cannot load)
    from mlx_lm.models.cache import trim_prompt_cache  # (MLX, as above)

    from .engine.model_parts import trimmable_cache  # (MLX, as above)

    engine, host, model = pipe.engine, pipe.engine.draft_host, pipe.model
    if host is None:
        raise ValueError("the pipeline has no draft")
    context = list(pipe.tokenizer.encode(PROBE_TEXT))
    if len(context) < gamma + 4:
        raise ValueError(f"the probe text is only {len(context)} tokens for this tokenizer")
    n = gamma + 1
    rows = mx.array([context[-n:]])
    spine = context[-1 - gamma: -1]
    stems = [spine[:r] + [(context[-1] + 1 + v) % host.vocab_size] for r in range(gamma + 1) for v in range(kappa)]
    prefix = context[:-1]

    def prefill():
        cache = trimmable_cache(model)
        model(mx.array([prefix]), cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    cache = engine.on_target(prefill)

    def forward() -> float:
        t0 = time.perf_counter()
        mx.eval(model(rows, cache=cache))
        elapsed = time.perf_counter() - t0
        trim_prompt_cache(cache, n)
        return elapsed

    def rollout(with_target: bool = False) -> float:
        host.post_sync(prefix[:-2])  # two tokens arrive with the rollout request, as in a real step
        host.wait_done(30.0)
        t0 = time.perf_counter()
        target = engine.submit_on_target(forward) if with_target else None
        host.rollout(prefix, stems, gamma, timeout=30.0)  # (with the target: waited for while it runs)
        if target is not None:
            target.result()
        return time.perf_counter() - t0

    pieces: dict[str, Callable[[], float]] = {"target": lambda: engine.on_target(forward), "draft": rollout,
                                              "both": lambda: rollout(with_target=True)}
    times: dict[str, list[float]] = {name: [] for name in pieces}
    for fn in pieces.values():  # warm-up: first calls compile and page in
        fn()
    end = time.perf_counter() + seconds
    while len(times["both"]) < min_rounds or time.perf_counter() < end:
        for name, fn in pieces.items():
            times[name].append(fn())
    return {k: statistics.median(v) for k, v in times.items()}, len(times["both"])


def overlap_lines(model: Optional[str], draft_model: Optional[str], seconds: float) -> list[str]:
    if draft_model is not None and str(draft_model).endswith(".mlpackage") and sys.platform != "darwin":
        return [f"overlap probe: skipped ({draft_model} is a Core ML package: it runs only on macOS; "
                "leave out --draft-model to probe the demo pair here)"]

    t0 = time.perf_counter()
    try:
        pipe = mirror_mlx.load(model, draft_model)
    except Exception as e:
        return [f"problem: could not load the pair for the overlap probe: {type(e).__name__}: {e}"]
    try:
        if not pipe.engine.has_draft:
            return ["overlap probe: skipped (no draft model)"]
        loaded = time.perf_counter() - t0
        t, rounds = probe_overlap(pipe, seconds)
        longer = max(t["target"], t["draft"])
        ratio, serial = t["both"] / longer, (t["target"] + t["draft"]) / longer  # 1.0 = the shorter one hidden
        pair = ("the demo pair" if model is None and draft_model is None
                else f"{model or 'the demo target'} + {draft_model or 'the demo draft'}")
        ms = lambda s: f"{1e3 * s:.2f} ms"  # noqa: E731
        where = ("target on the GPU, draft in its own process" if sys.platform == "darwin"
                 else "CPU analog: both on the CPU, draft in its own process")
        return [f"overlap probe ({pair}, loaded in {loaded:.1f} s; {where}; {rounds} rounds):",
                f"  target forward alone {ms(t['target'])}, draft rollout alone {ms(t['draft'])} "
                f"({pipe.engine.draft_kind}), both at once {ms(t['both'])}",
                f"  both / longer alone = {ratio:.2f} (1.00 = fully overlapped; {serial:.2f} = one after "
                f"the other){'' if ratio < 0.5 * (1 + serial) else '  <- mostly serialized'}"]
    except Exception as e:
        return [f"problem: the overlap probe failed: {type(e).__name__}: {e}"]
    finally:
        pipe.close()


def report(model: Optional[str] = None, draft_model: Optional[str] = None, seconds: float = 2.0) -> Iterator[str]:
    """The doctor's lines, cheap ones first (each is yielded as soon as it is known)."""
    yield f"mirror-mlx {__version__} doctor"
    yield from machine_lines()
    yield f"Python: {platform.python_version()} ({sys.executable})"
    yield from mlx_lines()
    yield from coreml_lines(draft_model)
    yield from compute_plan_lines(draft_model)
    yield from overlap_lines(model, draft_model, seconds)
    if sys.platform != "darwin":
        yield ("not checked here (needs a Mac with Apple silicon): the Metal GPU, Core ML's runtime and its "
               "Neural Engine placement, and the GPU ‖ Neural Engine overlap the product is built for")
