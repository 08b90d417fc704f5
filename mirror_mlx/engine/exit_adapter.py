"""A learned early-exit adapter: a small residual map on the normalised layer-ℓ_e state.

The bare head at ℓ_e guesses the final distribution poorly on shallow targets (docs/design.md §3 step 2).
The adapter sits between the target's final norm and its head at the early exit only, and is
distilled so that head(adapter(norm(h_ℓe))) matches the target's final distribution on the target's
own greedy text. It never touches the final logits, so generated tokens cannot change. This module is what
the runtime needs (the adapter, its file, the engine's pick per layer); training is mirror_mlx/train/exit_adapter.py.
"""

import hashlib
import json
from pathlib import Path
from typing import Optional, Union, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .model_parts import flat, text_model
from ..validate import check_layer

FORMAT = "mirror-mlx-exit-adapter"
VERSION = "1"


class ExitAdapter(nn.Module):
    """x ↦ x + up(act(down(x))) + bias, starting as the identity (so as the bare head): a low-rank linear map,
    or with `mlp` a residual MLP of width `rank` (which may exceed the model width)."""

    def __init__(self, dims: int, rank: int, mlp: bool = True):
        super().__init__()
        self.dims, self.rank, self.mlp = dims, rank, mlp
        self.down = nn.Linear(dims, rank, bias=mlp)
        self.up = nn.Linear(rank, dims, bias=True)
        self.up.weight = mx.zeros_like(self.up.weight)
        self.up.bias = mx.zeros_like(self.up.bias)

    def __call__(self, x: mx.array) -> mx.array:
        z = self.down(x.astype(mx.float32))
        if self.mlp:
            z = nn.silu(z)
        return (x + self.up(z)).astype(x.dtype)


def fingerprint(model: nn.Module, rows: int = 4096) -> str:
    """sha256 over the model's config, every parameter's name/shape/dtype, and its embedding and final norm.

    Only `rows` evenly strided rows of each array are hashed, so a 150k-token embedding costs milliseconds.
    """
    h = hashlib.sha256()
    args = getattr(text_model(model), "args", None) or getattr(model, "args", None)
    if args is not None:
        h.update(json.dumps(vars(args), sort_keys=True, default=str).encode())
    for name, a in sorted(flat(model.parameters()), key=lambda kv: kv[0]):
        h.update(f"{name}:{tuple(a.shape)}:{a.dtype};".encode())
    inner = text_model(model).model
    for part in ("embed_tokens", "norm"):
        mod = getattr(inner, part, None)
        if mod is None:
            continue
        for name, a in sorted(flat(mod.parameters()), key=lambda kv: kv[0]):
            a = a[:: max(1, a.shape[0] // rows)] if a.ndim > 1 else a
            h.update(name.encode())
            h.update(np.array(a.view(mx.uint8) if a.dtype == mx.bfloat16 else a).tobytes())
    return h.hexdigest()


# ---- files


def save_adapter(path: Union[str, Path], adapter: ExitAdapter, meta: dict[str, object]) -> None:
    """Weights as safetensors; `meta` must hold at least fingerprint and exit_layer (see adapter_meta)."""
    for key in ("fingerprint", "exit_layer"):
        if key not in meta:
            raise ValueError(f"adapter metadata needs '{key}'")
    md = {k: str(v) for k, v in meta.items()}
    md.update(format=FORMAT, version=VERSION, dims=str(adapter.dims), rank=str(adapter.rank),
              mlp=str(int(adapter.mlp)))
    mx.save_safetensors(str(path), dict(flat(adapter.parameters())), metadata=md)


def adapter_meta(model: nn.Module, exit_layer: int, **extra: object) -> dict[str, object]:
    return {"fingerprint": fingerprint(model), "exit_layer": exit_layer, **extra}


def load_adapter(path: Union[str, Path], model: nn.Module, exit_layer: Optional[int] = None) -> ExitAdapter:
    """Load an adapter, refusing one made for another model or (if given) another exit layer.

    The adapter keeps its layer in `adapter.exit_layer`; an engine that picks the layer later
    calls `check_layer(adapter, layer)`.
    """
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"no exit adapter at {file}")
    try:
        weights, md = cast(tuple[dict[str, mx.array], dict[str, str]], mx.load(str(file), return_metadata=True))
    except Exception as e:
        raise ValueError(f"{file} is not a safetensors file ({e})") from None
    if md.get("format") != FORMAT:
        raise ValueError(f"{file} is not a mirror-mlx exit adapter (made by `mirror-mlx train-exit`)")
    adapter = ExitAdapter(int(md["dims"]), int(md["rank"]), bool(int(md["mlp"])))
    adapter.load_weights(list(weights.items()), strict=True)
    mx.eval(adapter.parameters())
    adapter.exit_layer = int(md["exit_layer"])
    if md.get("exit_layers"):
        adapter.exit_layers = tuple(int(x) for x in md["exit_layers"].split(","))
    if md["fingerprint"] != fingerprint(model):
        raise ValueError(
            f"exit adapter {path} was trained for another model (fingerprint {md['fingerprint'][:12]}, "
            f"this model is {fingerprint(model)[:12]}); train one for it with `mirror-mlx train-exit`"
        )
    if exit_layer is not None:
        check_layer(adapter, exit_layer, f"exit adapter {path}")
    return adapter


class ExitAdapters:
    """Several exit adapters of one target, each for its own exit layers; the engine takes the one for ℓ_e."""

    def __init__(self, adapters: list[ExitAdapter]):
        self.by_layer: dict[int, ExitAdapter] = {}
        for a in adapters:
            for layer in getattr(a, "exit_layers", (a.exit_layer,)):
                if layer in self.by_layer:
                    raise ValueError(f"two exit adapters are for exit layer {layer}: give one per layer")
                self.by_layer[layer] = a
        self.exit_layer = adapters[0].exit_layer  # the default ℓ_e, as with one adapter
        self.exit_layers = tuple(sorted(self.by_layer))

    def for_layer(self, exit_layer: int) -> ExitAdapter:
        return self.by_layer[exit_layer]


def adapter_for(adapter: "Union[ExitAdapter, ExitAdapters, None]", exit_layer: int) -> Optional[ExitAdapter]:
    """The adapter that maps `exit_layer`'s state: one of several (ExitAdapters), else the one given (or None)."""
    return adapter.for_layer(exit_layer) if isinstance(adapter, ExitAdapters) else adapter


def adapter_layers(adapter: "Union[ExitAdapter, ExitAdapters, None]") -> tuple:
    """The exit layers an adapter (or several) is exact at; () for no adapter."""
    if adapter is None:
        return ()
    return tuple(getattr(adapter, "exit_layers", None) or (adapter.exit_layer,))


def load_adapters(paths: Union[str, Path], model: nn.Module) -> Union[ExitAdapter, ExitAdapters]:
    """One adapter file, or several separated by commas (one per exit layer), each checked against `model`."""
    parts = [p.strip() for p in str(paths).split(",") if p.strip()]
    if len(parts) == 1:
        return load_adapter(Path(parts[0]), model)
    return ExitAdapters([load_adapter(Path(p), model) for p in parts])
