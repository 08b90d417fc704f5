"""Run a saved Core ML package's MIL program on Linux, op by op, with numpy.

Core ML cannot predict on Linux, but every MIL op class carries a numpy `value_inference`. We
re-read the *saved* package (milproto -> pymil), bind inputs and state, and evaluate each op in
order; ops without one (conv, silu, the state ops, constexpr_*) get numpy stand-ins, and so do
layer_norm (float32 statistics) and matmul (speed). Each op computes in float32 and its fp16
outputs are rounded to fp16, like fp16 storage with wide accumulators on the ANE; ops that only
move values are not rounded again (their fp16 inputs are exact). This checks graph structure,
layout and fp16 range; ANE arithmetic itself only a Mac can check.
"""

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

if TYPE_CHECKING:
    from coremltools.converters.mil.mil import Function, Operation, Program, Var


class _Held:
    """A value slot that pymil's Var.val reads (bypasses its fp32->fp16 cast-with-warning)."""

    __slots__ = ("val",)

    def __init__(self, val: np.ndarray):
        self.val = val


def load_program(package: Path) -> "Program":
    """The pymil Program stored in a .mlpackage (all functions)."""
    import coremltools as ct  # (coremltools: an extra off macOS)
    from coremltools.converters.mil.frontend.milproto.load import load  # (coremltools: an extra off macOS)

    spec = ct.utils.load_spec(str(package))
    weights = Path(package) / "Data" / "com.apple.CoreML" / "weights"
    return load(spec, spec.specificationVersion, str(weights))


def _conv(op: "Operation", env: "MilRunner") -> np.ndarray:
    x, w = op.x.val, op.weight.val
    if w.shape[2:] != (1, 1) or (op.groups is not None and op.groups.val != 1):
        raise NotImplementedError(f"conv stand-in handles 1x1 convolutions only ({op.name})")
    b, c, h, wd = x.shape
    w = np.asarray(w, np.float32).reshape(w.shape[0], w.shape[1])  # a view: weights are float32 already
    y = np.matmul(w, np.asarray(x, np.float32).reshape(b, c, h * wd)).reshape(b, -1, h, wd)
    if op.bias is not None:
        y = y + op.bias.val.astype(np.float32)[None, :, None, None]
    return y


def _silu(op: "Operation", env: "MilRunner") -> np.ndarray:
    x = np.asarray(op.x.val, np.float32)
    return x / (1.0 + np.exp(-x))


def _read_state(op: "Operation", env: "MilRunner") -> np.ndarray:
    return env.state[op.input.name]


def _update_state(op: "Operation", env: "MilRunner") -> np.ndarray:
    value: np.ndarray = op.value.val  # slice_update's own copy of the state: held as the new state, not copied again
    env.state[op.state.name] = value if value is not env.state.get(op.state.name) else value.copy()
    return value


def _layer_norm(op: "Operation", env: "MilRunner") -> np.ndarray:
    # float32 statistics (the op's own value_inference squares in the input dtype)
    x = np.asarray(op.x.val, np.float32)
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


def _matmul(op: "Operation", env: "MilRunner") -> np.ndarray:
    # float32; small products through einsum's own loop (threaded BLAS on a busy machine was
    # 10-50x slower on a tiny draft's attention shapes), large ones through BLAS
    x, y = np.asarray(op.x.val, np.float32), np.asarray(op.y.val, np.float32)
    if op.transpose_x.val:
        x = np.swapaxes(x, -1, -2)
    if op.transpose_y.val:
        y = np.swapaxes(y, -1, -2)
    if x.shape[-2] * x.shape[-1] * y.shape[-1] < 1 << 20:
        return np.einsum("...ij,...jk->...ik", x, y)
    return np.matmul(x, y)


def _constexpr(op: "Operation") -> np.ndarray:
    if op.op_type == "constexpr_lut_to_dense" and op.lut.val.shape[-1] == 1:
        return _lut_to_dense(op.indices.val, op.lut.val[..., 0])
    return op.materialized_val_inference()


def _lut_to_dense(indices: np.ndarray, table: np.ndarray) -> np.ndarray:
    """A palettized weight: table (*groups, palette) looked up at each index, in one fancy-indexing
    lookup (coremltools' own repeats the palette for every weight: 0.5-2 GB for one head piece)."""
    r = indices.ndim
    ix = tuple((np.arange(n) // (n // g)).reshape([-1 if j == k else 1 for j in range(r)])
               for k, (n, g) in enumerate(zip(indices.shape, table.shape[:-1])))
    return table[ix + (indices,)]


def _set_const(op: "Operation", value: "Optional[_Held]") -> None:
    """A const op's value, held both as its output's and as the op's own `val` input."""
    op.outputs[0]._sym_val = value
    inner = getattr(op, "val", None)
    if inner is not None and hasattr(inner, "_sym_val"):
        inner._sym_val = value


def _release_inputs(op: "Operation") -> None:
    """Drop the constants only this (materialised, never run again) op reads: a lut4 package's
    indices are a byte per weight in each function, 1.2 GB at 0.6B."""
    for var in op.inputs.values():
        src = getattr(var, "op", None)
        if src is not None and src.op_type == "const" and len(var.child_ops) == 1:
            _set_const(src, None)


STAND_INS: dict[str, Callable[["Operation", "MilRunner"], np.ndarray]] = {
    "conv": _conv,
    "silu": _silu,
    "read_state": _read_state,
    "coreml_update_state": _update_state,
    "layer_norm": _layer_norm,
    "matmul": _matmul,
}


# ops whose outputs are some of their inputs' values, moved or selected, never computed: an fp16
# output of fp16 inputs is already exact in fp16 (every stored fp16 value is), so it is not rounded
MOVES = frozenset({"read_state", "coreml_update_state", "reshape", "transpose", "concat", "split",
                   "slice_by_size", "slice_by_index", "slice_update", "gather", "gather_along_axis",
                   "tile", "select", "squeeze", "expand_dims", "identity", "stack"})


class Weights:
    """The package's constants as float32, one array per distinct value: both functions of a loaded
    package hold their own copy of every weight, the runner keeps one (4 bytes a parameter)."""

    def __init__(self) -> None:
        self.arrays: dict[tuple, list[np.ndarray]] = {}

    def share(self, val: np.ndarray) -> np.ndarray:
        """`val` as a float32 array, the same object for equal values (a strided sample of the bytes
        finds the candidates, a full comparison decides)."""
        flat = val.reshape(-1)
        key = (val.shape, val.dtype.str, flat[:: max(1, flat.size // 4096)].tobytes(), flat[-64:].tobytes())
        same = self.arrays.setdefault(key, [])
        for a in same:
            if np.array_equal(a, val):
                return a
        same.append(np.array(val, np.float32, order="C"))
        return same[-1]

    def adopt(self, program: "Program") -> None:
        """Replace every fp16 tensor constant of `program` by its shared float32 array; the fp16
        copies the loader made are freed as it goes (peak: one function's fp16 plus the float32)."""
        for f in program.functions.values():
            for op in f.operations:
                if op.op_type != "const":
                    continue
                val = op.outputs[0].val
                if isinstance(val, np.ndarray) and val.dtype == np.float16 and val.ndim:
                    _set_const(op, _Held(self.share(val)))


_LO = np.uint32(0x38800000)  # the bits of 2**-14, fp16's smallest normal
_SPAN = np.uint32(0x477FF000 - 0x38800000)  # up to 65520, where fp16 rounding overflows to inf
_ZERO = np.uint32((1 << 32) - 0x38800000)  # +-0 after subtracting _LO


def round_fp16(a: np.ndarray) -> np.ndarray:
    """Round a float32 array (C-contiguous, writable) to fp16 values in place, bit for bit as
    `astype(float16).astype(float32)`, ~3x faster (numpy's float16 cast is a scalar loop): the normal
    range on the bits (round half to even, cut 13 bits), the rare rest through numpy's cast."""
    flat = a.reshape(-1)
    u = flat.view(np.uint32)
    t = u & np.uint32(0x7FFFFFFF)
    t -= _LO
    odd = t >= _SPAN
    odd &= t != _ZERO
    idx = np.flatnonzero(odd) if odd.any() else np.empty(0, np.intp)
    keep = flat[idx]
    np.right_shift(u, np.uint32(13), out=t)
    t &= np.uint32(1)
    t += np.uint32(0xFFF)
    u += t
    u &= np.uint32(0xFFFFE000)
    if idx.size:
        with np.errstate(over="ignore"):  # overflow is inf, as on the ANE; the parity check reports it
            flat[idx] = keep.astype(np.float16).astype(np.float32)
    return a


def _store(var: "Var", value: np.ndarray, exact: bool = False, fresh: bool = False) -> None:
    """Hold `value` as `var`'s value: fp16 as float32 rounded to fp16 (unless `exact`), other types as
    their numpy type. `fresh`: an op's output, rounded in place (its own array, or an fp16-exact input
    passed through, which rounding leaves as it is); a caller's input is copied."""
    from coremltools.converters.mil.mil import types  # (coremltools: an extra off macOS)

    a = np.asarray(value)
    dt = var.dtype
    if dt == types.fp16:  # fp16 storage, fp32 compute
        if exact:
            a = np.asarray(a, np.float32)
        elif a.ndim == 0:
            a = a.astype(np.float16).astype(np.float32)
        else:
            if not (fresh and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable):
                a = np.array(a, np.float32, order="C")
            a = round_fp16(a)
    elif dt in (types.fp32, types.bool) or types.is_int(dt):
        a = a.astype(types.nptype_from_builtin(dt))
    var._sym_val = _Held(a)


def run_function(function: "Function", inputs: dict[str, np.ndarray], env: "MilRunner") -> dict[str, np.ndarray]:
    """Evaluate one pymil Function; `env.state` is read and updated in place. Returns outputs."""
    from coremltools.converters.mil.mil import types  # (coremltools: an extra off macOS)

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
        if op.op_type.startswith("constexpr_"):  # materialised once per runner, shared by functions
            v = np.asarray(_constexpr(op))
            op.outputs[0]._sym_val = _Held(env.weights.share(v) if v.dtype == np.float16 else v)
            _release_inputs(op)
            continue
        stand_in = STAND_INS.get(op.op_type)
        vals = stand_in(op, env) if stand_in else op.value_inference()
        if not isinstance(vals, (tuple, list)) or len(op.outputs) == 1:
            vals = (vals,)
        exact = op.op_type in MOVES
        for var, v in zip(op.outputs, vals):
            if v is None:
                raise NotImplementedError(f"no value for op {op.op_type} ({op.name})")
            _store(var, v.val if hasattr(v, "val") and not isinstance(v, np.ndarray) else v, exact, fresh=True)
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
    """A package's `extend`/`rollout` functions evaluated with numpy, sharing one KV state; the same
    interface as the macOS Core ML runner: call(fn, inputs) -> outputs; reset()."""

    def __init__(self, package: Path):
        self.program = load_program(Path(package))
        self.weights = Weights()  # kept across resets: they are the package's constants
        self.weights.adopt(self.program)
        self.reset()

    def reset(self) -> None:
        self.state: dict[str, np.ndarray] = {}  # KV state arrays by state input name

    def call(self, fn: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return run_function(self.program.functions[fn], inputs, self)
