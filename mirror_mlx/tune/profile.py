"""Tuning profiles on disk: what `mirror-mlx tune` chose for one (target, draft, adapter, machine).

A profile is keyed by fingerprints of the weights themselves (names, shapes and a sample of the
values of every tensor), so another model, another draft or another adapter never reuses it, even
from the same path. It lives in the user cache directory: $MIRROR_MLX_CACHE if set, else
$XDG_CACHE_HOME/mirror-mlx (Linux) or ~/Library/Caches/mirror-mlx (macOS).
"""

import hashlib
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..blas import cpu_name

VERSION = 2  # 2: rows carry measured_step_ms, calibration the acceptance counts (tune.adapt)


class ProfileError(ValueError):
    """A profile file that cannot be read back."""


def cache_dir() -> Path:
    env = os.environ.get("MIRROR_MLX_CACHE")
    if env:
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "mirror-mlx"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mirror-mlx"


def fingerprint(module: Any) -> str:
    """A short hash of a module's weights: every tensor's name, shape, dtype and first/last values."""
    if module is None:
        return "none"
    if hasattr(module, "build") and hasattr(module, "args"):  # a DraftRecipe: the draft lives in its host
        return _recipe_fingerprint(module)
    params = getattr(module, "parameters", None)
    if params is None:  # a draft that is not an mlx module (Core ML): its class and its path if any
        return hashlib.sha1(f"{type(module).__name__}:{getattr(module, 'path', '')}".encode()).hexdigest()[:16]
    h = hashlib.sha1()
    for name, w in tree_flatten(params()):
        flat = w.reshape(-1)
        sample = mx.concatenate([flat[:32], flat[-32:]]).astype(mx.float32)
        h.update(f"{name}:{tuple(w.shape)}:{w.dtype};".encode())
        h.update(np.array(sample).tobytes())
    return h.hexdigest()[:16]


def _recipe_fingerprint(recipe: Any) -> str:
    """A DraftRecipe's builder and the files it reads: each file's name, size and first/last 4 KiB."""
    h = hashlib.sha1(f"{getattr(recipe.build, '__name__', recipe.build)}".encode())
    for arg in recipe.args:
        h.update(f"|{arg}".encode())
        path = Path(str(arg))
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.is_file() else []
        for f in files:
            size = f.stat().st_size
            h.update(f"{f.relative_to(path) if path.is_dir() else f.name}:{size};".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(4096))
                fh.seek(max(0, size - 4096))
                h.update(fh.read(4096))
    return h.hexdigest()[:16]


def machine() -> str:
    """The machine a timing belongs to: OS, CPU, core count and MLX's device."""
    return f"{platform.system()} {platform.machine()} | {cpu_name()} | {os.cpu_count()} cores | {mx.default_device()}"


@dataclass
class Profile:
    """The choice (mode and knobs), why, and the table it came from."""

    key: dict
    mode: str
    kappa: Optional[int] = None
    gamma: Optional[int] = None
    exit_layer: Optional[int] = None
    why: str = ""
    table: list = field(default_factory=list)  # rows: config fields + predicted / measured tokens/s
    calibration: dict = field(default_factory=dict)  # the measured timings and acceptance, for reading
    version: int = VERSION


def key_for(target: Any, draft: Any = None, adapter: Any = None) -> dict:
    draft_module = getattr(draft, "model", draft)
    return {"target": fingerprint(target), "draft": fingerprint(draft_module), "adapter": fingerprint(adapter),
            "machine": machine()}


def path_for(key: dict) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"profile-{digest}.json"


def save(profile: Profile) -> Path:
    path = path_for(profile.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(profile), indent=1, default=str))
    tmp.replace(path)  # atomic: a reader never sees half a profile
    return path


def load(key: dict) -> Optional[Profile]:
    """The profile for `key`, None if there is none; ProfileError if the file is unreadable."""
    path = path_for(key)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        profile = Profile(**data)
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as e:
        raise ProfileError(f"the tuning profile {path} is corrupt ({type(e).__name__}): "
                           "delete it or run `mirror-mlx tune` again") from None
    if profile.version != VERSION or profile.key != key or profile.mode not in ("mirror", "sd", "ar"):
        raise ProfileError(f"the tuning profile {path} does not match this model pair, machine or version: "
                           "delete it or run `mirror-mlx tune` again")
    return profile
