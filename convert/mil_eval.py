"""Run a saved Core ML package's MIL program on Linux, op by op, with numpy.

Core ML cannot predict on Linux, but every MIL op class carries a numpy `value_inference`. We
re-read the *saved* package (milproto -> pymil), bind inputs and state, and evaluate each op in
order; ops without value inference (conv, silu, read_state, coreml_update_state, constexpr_*) get
small numpy stand-ins here, and so do layer_norm (float32 statistics) and matmul (speed). Arithmetic model: each op computes in float32 and its fp16 outputs are
rounded to fp16, like fp16 storage with wide accumulators on the ANE.

Speed at real size (0.6B): a conv is one BLAS matmul against its weight converted to float32
once per runner (one copy per distinct weight, 4 bytes each), and large attention products go to
BLAS too: a 64-row rollout call of a 0.6B draft is ~75 GFLOP of BLAS, not numpy's einsum loop. This checks graph structure,
layout and fp16 range; ANE arithmetic itself (its rounding, its kernels) only a Mac can check.
"""

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np


class _Held:
    """A value slot that pymil's Var.val reads (bypasses its fp32->fp16 cast-with-warning)."""

    __slots__ = ("val",)

    def __init__(self, val: np.ndarray):
        self.val = val


def load_program(package: Path) -> Any:
    """The pymil Program stored in a .mlpackage (all functions)."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load

    spec = ct.utils.load_spec(str(package))
    weights = Path(package) / "Data" / "com.apple.CoreML" / "weights"
    return load(spec, spec.specificationVersion, str(weights))


def _conv(op: Any, env: "Env") -> np.ndarray:
    x, w = op.x.val, op.weight.val
    if w.shape[2:] != (1, 1) or (op.groups is not None and op.groups.val != 1):
        raise NotImplementedError(f"conv stand-in handles 1x1 convolutions only ({op.name})")
    b, c, h, wd = x.shape
    y = np.matmul(env.float32(op.weight), x.astype(np.float32).reshape(b, c, h * wd)).reshape(b, -1, h, wd)
    if op.bias is not None:
        y = y + op.bias.val.astype(np.float32)[None, :, None, None]
    return y


def _silu(op: Any, env: "Env") -> np.ndarray:
    x = op.x.val.astype(np.float32)
    return x / (1.0 + np.exp(-x))


def _read_state(op: Any, env: "Env") -> np.ndarray:
    return env.state[op.input.name]


def _update_state(op: Any, env: "Env") -> np.ndarray:
    env.state[op.state.name] = np.asarray(op.value.val, np.float32).copy()
    return op.value.val


def _layer_norm(op: Any, env: "Env") -> np.ndarray:
    # float32 statistics (the op's own value_inference squares in the input dtype)
    x = op.x.val.astype(np.float32)
    axes = tuple(int(a) for a in op.axes.val)
    mu = x.mean(axis=axes, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mu) / np.sqrt(var + float(op.epsilon.val))
    shape = [x.shape[i] if i in axes else 1 for i in range(x.ndim)]
    if op.gamma is not None:
        y = y * op.gamma.val.astype(np.float32).reshape(shape)
    if op.beta is not None:
        y = y + op.beta.val.astype(np.float32).reshape(shape)
    return y


def _matmul(op: Any, env: "Env") -> np.ndarray:
    # float32; small products through einsum's own loop (threaded BLAS on a busy machine was
    # 10-50x slower on a tiny draft's attention shapes), large ones through BLAS
    x, y = op.x.val.astype(np.float32), op.y.val.astype(np.float32)
    if op.transpose_x.val:
        x = np.swapaxes(x, -1, -2)
    if op.transpose_y.val:
        y = np.swapaxes(y, -1, -2)
    if x.shape[-2] * x.shape[-1] * y.shape[-1] < 1 << 20:
        return np.einsum("...ij,...jk->...ik", x, y)
    return np.matmul(x, y)


def _constexpr(op: Any, env: "Env") -> Any:
    return op.materialized_val_inference()


STAND_INS: dict[str, Callable[[Any, "Env"], Any]] = {
    "conv": _conv,
    "silu": _silu,
    "read_state": _read_state,
    "coreml_update_state": _update_state,
    "layer_norm": _layer_norm,
    "matmul": _matmul,
}


@dataclass
class Env:
    """Evaluation state: KV state arrays keyed by state input name, and the float32 conv weights
    (kept across resets: they are the package's constants)."""

    state: dict[str, np.ndarray] = field(default_factory=dict)
    weights: dict[Any, np.ndarray] = field(default_factory=dict)

    def float32(self, var: Any) -> np.ndarray:
        """A conv weight (O, C, 1, 1) as float32 (O, C), converted once. Keyed by content: each
        function of a loaded package has its own copy of every weight, the cache holds one."""
        key = self.weights.get(id(var))
        if key is None:
            w = var.val
            key = (w.shape, hashlib.sha1(np.ascontiguousarray(w).view(np.uint8)).digest())
            self.weights[id(var)] = key
            if key not in self.weights:
                self.weights[key] = np.ascontiguousarray(w[:, :, 0, 0], np.float32)
        return self.weights[key]


def _store(var: Any, value: Any) -> None:
    from coremltools.converters.mil.mil import types

    a = np.asarray(value)
    dt = var.dtype
    if dt == types.fp16:
        a = a.astype(np.float16).astype(np.float32)  # fp16 storage, fp32 compute
    elif dt == types.fp32:
        a = a.astype(np.float32)
    elif types.is_int(dt):
        a = a.astype(types.nptype_from_builtin(dt))
    elif dt == types.bool:
        a = a.astype(bool)
    var._sym_val = _Held(a)


def run_function(function: Any, inputs: dict[str, np.ndarray], env: Env) -> dict[str, np.ndarray]:
    """Evaluate one pymil Function; `env.state` is read and updated in place. Returns outputs."""
    from coremltools.converters.mil.mil import types

    for name, var in function.inputs.items():
        if types.is_state(var.sym_type):
            if name not in env.state:
                shape = var.sym_type.wrapped_type().get_shape()
                env.state[name] = np.zeros(shape, np.float32)
            continue
        if name not in inputs:
            raise KeyError(f"missing input {name!r} for function")
        want = tuple(var.shape)
        got = np.asarray(inputs[name])
        if got.shape != want:
            raise ValueError(f"input {name!r} has shape {got.shape}, the function wants {want}")
        _store(var, got)
    for op in function.operations:
        if op.op_type == "const" or (op.op_type.startswith("constexpr_") and op.outputs[0].val is not None):
            continue
        if op.op_type.startswith("constexpr_"):
            vals = _constexpr(op, env)
        elif op.op_type in STAND_INS:
            vals = STAND_INS[op.op_type](op, env)
        else:
            vals = op.value_inference()
        if not isinstance(vals, (tuple, list)) or len(op.outputs) == 1:
            vals = (vals,)
        for var, v in zip(op.outputs, vals):
            if v is None:
                raise NotImplementedError(f"no value for op {op.op_type} ({op.name})")
            _store(var, v.val if hasattr(v, "val") and not isinstance(v, np.ndarray) else v)
    out = {v.name: np.asarray(v.val, np.float32) for v in function.outputs}
    for var in function.inputs.values():  # leave no constants behind in the program
        if not types.is_state(var.sym_type):
            var._sym_val = None
    for op in function.operations:  # nor this call's values (a 0.6B draft's KV copies are GBs)
        if op.op_type != "const" and not op.op_type.startswith("constexpr_"):
            for var in op.outputs:
                var._sym_val = None
    return out


class MilRunner:
    """A package's `extend`/`rollout` functions evaluated with numpy, sharing one KV state.

    The same interface as the macOS Core ML runner: call(fn, inputs) -> outputs; reset().
    """

    def __init__(self, package: Path, program: Any = None):
        self.program = program if program is not None else load_program(Path(package))
        self.env = Env()

    def reset(self) -> None:
        self.env = Env(weights=self.env.weights)

    def call(self, fn: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return run_function(self.program.functions[fn], inputs, self.env)


def op_types(program: Any) -> set[str]:
    """Every op type used by every function of a program."""
    return {op.op_type for f in program.functions.values() for op in f.operations}
