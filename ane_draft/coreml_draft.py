"""The Core ML draft on macOS 15+: the package runs on the Neural Engine in its own process.

`MLModel.predict` holds the GIL for the whole call (ecosystem.md §3.6), so the draft lives in a
child process; requests (committed context, stems, gamma) and replies (windows) travel through two
shared-memory TokenRings (mirror_mlx/ring.py), a few kilobytes per rollout. The child runs the
platform-free host code (package_host.PackageDraft) over the package's `extend` and `rollout`
functions loaded with compute units CPU_AND_NE and one shared `make_state()` KV cache.

On Linux, constructing CoreMLDraft raises CoreMLUnavailable at once; the same process plumbing is
exercised there with the MIL evaluator as backend (`ProcessDraft(package, backend="mil")`).
"""

import multiprocessing as mp
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from mirror_mlx.convert.coreml import ConvertError, read_metadata, tokenizer_sha256
from mirror_mlx.draft_api import Rollout
from mirror_mlx.ring import TokenRing

MESSAGE = "Core ML runs on macOS 15+; use the MLX draft folder here"

READY, ROLLOUT, RESET, STOP, WINDOWS, DONE, ERROR = 20, 21, 22, 23, 24, 25, 26


class CoreMLUnavailable(RuntimeError):
    """Core ML cannot run on this machine (not macOS 15+, or coremltools without its runtime)."""


def coreml_available() -> bool:
    """True on macOS 15+ with coremltools' native runtime importable."""
    if sys.platform != "darwin":
        return False
    try:
        if int(platform.mac_ver()[0].split(".")[0]) < 15:
            return False
        from coremltools import libcoremlpython  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


class CoreMLRunner:
    """The package's two functions under Core ML, sharing one KV state (macOS 15+ only)."""

    def __init__(self, package: Path):
        import coremltools as ct

        cu = ct.ComputeUnit.CPU_AND_NE
        compiled = ct.models.utils.compile_model(str(package))  # once, for both functions
        self.models = {fn: ct.models.CompiledMLModel(compiled, compute_units=cu, function_name=fn)
                       for fn in ("extend", "rollout")}
        self.reset()

    def reset(self) -> None:
        self.state = self.models["extend"].make_state()

    def call(self, fn: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.models[fn].predict(inputs, state=self.state)
        self._keep = inputs  # Core ML may release inputs on its own queue (coremltools PR #2827)
        return out


def make_runner(package: Path, backend: str) -> Any:
    if backend == "coreml":
        return CoreMLRunner(package)
    if backend == "mil":
        from mirror_mlx.convert.mil_eval import MilRunner

        return MilRunner(package)
    raise ValueError(f"unknown draft backend {backend!r} (use 'coreml' or 'mil')")


# ------------------------------------------------------------------ wire format (int64 words)


def _encode_text(text: str) -> list[int]:
    return list(text.encode("utf-8", "replace")[:4000])


def _decode_text(ints: np.ndarray) -> str:
    return bytes(int(i) for i in ints).decode("utf-8", "replace")


def encode_rollout(context: Sequence[int], stems: Sequence[Sequence[int]], gamma: int) -> list[int]:
    """[gamma, n_context, n_stems, len_0..len_k, context..., stem tokens...]"""
    out = [gamma, len(context), len(stems)] + [len(s) for s in stems] + list(context)
    for s in stems:
        out += list(s)
    return [int(x) for x in out]


def decode_rollout(ints: np.ndarray) -> tuple[list[int], list[list[int]], int]:
    gamma, n_ctx, n = (int(x) for x in ints[:3])
    lens = [int(x) for x in ints[3 : 3 + n]]
    i = 3 + n
    context = [int(x) for x in ints[i : i + n_ctx]]
    i += n_ctx
    stems = []
    for k in lens:
        stems.append([int(x) for x in ints[i : i + k]])
        i += k
    return context, stems, gamma


def _wait(ring: TokenRing, seq: int, timeout: Optional[float], alive: Any = None):
    """Poll `ring` for message `seq`: spin briefly, then back off to short sleeps."""
    start, delay = time.perf_counter(), 0.0
    while True:
        msg = ring.get(seq)
        if msg is not None:
            return msg
        elapsed = time.perf_counter() - start
        if timeout is not None and elapsed > timeout:
            raise TimeoutError(f"the Core ML draft process did not answer within {timeout:.0f} s")
        if alive is not None and delay >= 1e-3 and not alive():
            raise RuntimeError("the Core ML draft process exited unexpectedly")
        if elapsed > 1e-3:
            delay = min(1e-3, delay * 2 or 5e-6)
            time.sleep(delay)


def _serve(package: str, backend: str, req_name: str, rep_name: str, ring_kw: dict) -> None:
    """Child process: load the package, then answer rollout/reset requests until STOP."""
    from mirror_mlx.ane_draft.package_host import PackageDraft

    # attach only; the parent owns and unlinks the memory (spawned children share its tracker)
    req = TokenRing(name=req_name, create=False, **ring_kw)
    rep = TokenRing(name=rep_name, create=False, **ring_kw)
    parent = mp.parent_process()
    try:
        draft = PackageDraft(make_runner(Path(package), backend), read_metadata(Path(package)))
        rep.put(READY, 0, [draft.vocab_size])
    except Exception as e:  # noqa: BLE001
        rep.put(ERROR, 0, [0] + _encode_text(f"{type(e).__name__}: {e}"))
        return
    seq = 1
    while True:
        try:
            msg = _wait(req, seq, None, alive=lambda: parent is None or parent.is_alive())
        except RuntimeError:
            break
        seq += 1
        if msg.kind == STOP:
            break
        try:
            if msg.kind == RESET:
                draft.reset()
                rep.put(DONE, msg.step)
            elif msg.kind == ROLLOUT:
                r = draft.rollout(*decode_rollout(msg.ints))
                rep.put(WINDOWS, msg.step, [r.forwards, r.tokens, len(r.windows)] + [t for w in r.windows for t in w])
        except Exception as e:  # noqa: BLE001
            rep.put(ERROR, msg.step, [int(isinstance(e, ValueError))] + _encode_text(str(e)))
    req.close(unlink=False)
    rep.close(unlink=False)


class ProcessDraft:
    """The Draft protocol over a package run by a child process (backend 'coreml' or 'mil')."""

    def __init__(self, package: Path, backend: str = "coreml", timeout: float = 120.0):
        package = Path(package)
        meta = read_metadata(package)
        S, B, gamma = int(meta["context"]), int(meta["rows"]), int(meta["gamma"])
        self.timeout = timeout
        self.ring_kw = dict(capacity=4, max_ints=S + 2 * B * (2 * gamma + 2) + 64, max_floats=0)
        self.req = TokenRing(**self.ring_kw)
        self.rep = TokenRing(**self.ring_kw)
        ctx = mp.get_context("spawn")  # never fork a process that may hold Metal/MLX state
        self.proc = ctx.Process(target=_serve, daemon=True,
                                args=(str(package), backend, self.req.name, self.rep.name, self.ring_kw))
        self.proc.start()
        self._sent = 0
        self._seen = 0
        try:
            msg = self._reply()
        except BaseException:
            self.close()
            raise
        if msg.kind == ERROR:
            self.close()
            raise RuntimeError(f"the draft process could not load {package.name}: {_decode_text(msg.ints[1:])}")
        self.vocab_size = int(msg.ints[0])

    def _reply(self):
        self._seen += 1
        return _wait(self.rep, self._seen, self.timeout, alive=self.proc.is_alive)

    def _request(self, kind: int, ints: Sequence[int] = ()):
        self._sent += 1
        self.req.put(kind, self._sent, ints)
        msg = self._reply()
        if msg.kind == ERROR:
            text = _decode_text(msg.ints[1:])
            raise (ValueError if int(msg.ints[0]) else RuntimeError)(text)
        return msg

    def reset(self) -> None:
        self._request(RESET)

    def rollout(self, context: Sequence[int], stems: Sequence[Sequence[int]], gamma: int) -> Rollout:
        ints = encode_rollout(context, stems, gamma)
        if len(ints) > self.ring_kw["max_ints"]:
            raise ValueError(f"context and stems ({len(ints)} ints) exceed the package's context; "
                             "rebuild it with a larger --context")
        msg = self._request(ROLLOUT, ints)
        forwards, tokens, n = (int(x) for x in msg.ints[:3])
        flat = [int(x) for x in msg.ints[3:]]
        windows = [flat[i * gamma : (i + 1) * gamma] for i in range(n)]
        return Rollout(windows=windows, forwards=forwards, tokens=tokens)

    def close(self) -> None:
        if getattr(self, "proc", None) is None:
            return
        if self.proc.is_alive():
            try:
                self._sent += 1
                self.req.put(STOP, self._sent)
            except Exception:  # noqa: BLE001
                pass
            self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(timeout=5)
        self.proc = None
        self.req.close()
        self.rep.close()

    def __enter__(self) -> "ProcessDraft":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


class CoreMLDraft(ProcessDraft):
    """A `.mlpackage` draft on the Neural Engine (macOS 15+); raises CoreMLUnavailable elsewhere.

    Give the target's tokenizer to refuse a package built for another vocabulary up front.
    """

    def __init__(self, package: Path, tokenizer: Any = None, timeout: float = 120.0):
        if not coreml_available():
            raise CoreMLUnavailable(MESSAGE)
        package = Path(package)
        meta = read_metadata(package)
        if tokenizer is not None and meta["tokenizer_sha256"] != tokenizer_sha256(tokenizer):
            raise ConvertError(
                f"{package} was built for another tokenizer than the target's; "
                "convert a draft that shares the target's tokenizer"
            )
        super().__init__(package, backend="coreml", timeout=timeout)

