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
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Protocol, Sequence, Union

import mlx.core as mx
import numpy as np

from ..engine.model_parts import flat

if TYPE_CHECKING:
    import threading

    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from ..drafts.recipes import DraftRecipe
    from ..engine import Engine
    from ..chunks import Result
    from ..drafts.api import Draft

from ..options import DecodeOptions
from ..validate import MAX_BRANCHES, decode_options

VERSION = 4  # 2: rows carry measured_step_ms, calibration the acceptance counts (tune.adapt); 3: branch rollouts
# timed after mirror's prepare, and the prepare itself; 4: the recycled tree with the lookup measured (mode recycle)
MODES = ("mirror", "sd", "ar", "recycle")  # a profile's choice


class ProfileError(ValueError):
    """A profile file that cannot be read back."""


def cache_dir() -> Path:
    if env := os.environ.get("MIRROR_MLX_CACHE"):
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "mirror-mlx"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mirror-mlx"


def fingerprint(module: object) -> str:
    """A short hash of a module's weights: every tensor's name, shape, dtype and first/last values."""
    if module is None:
        return "none"
    if hasattr(module, "build") and hasattr(module, "args"):  # a DraftRecipe: the draft lives in its host
        return _recipe_fingerprint(module)  # type: ignore[arg-type]  # (hasattr narrows to no class)
    params = getattr(module, "parameters", None)
    if params is None:  # a draft that is not an mlx module (Core ML): its class and its path if any
        return hashlib.sha1(f"{type(module).__name__}:{getattr(module, 'path', '')}".encode()).hexdigest()[:16]
    h = hashlib.sha1()
    for name, w in flat(params()):
        values = w.reshape(-1)
        sample = mx.concatenate([values[:32], values[-32:]]).astype(mx.float32)
        h.update(f"{name}:{tuple(w.shape)}:{w.dtype};".encode())
        h.update(np.array(sample).tobytes())
    return h.hexdigest()[:16]


def _recipe_fingerprint(recipe: "DraftRecipe") -> str:
    """A DraftRecipe's builder and the files it reads: each file's name, size and first/last 4 KiB."""
    h = hashlib.sha1(f"{getattr(recipe.build, '__name__', recipe.build)}".encode())
    for arg in recipe.args:
        h.update(f"|{arg}".encode())
        path = Path(str(arg))
        files = sorted(filter(Path.is_file, path.rglob("*"))) if path.is_dir() else [path] if path.is_file() else []
        for f in files:
            size = f.stat().st_size
            h.update(f"{f.relative_to(path) if path.is_dir() else f.name}:{size};".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(4096))
                fh.seek(max(0, size - 4096))
                h.update(fh.read(4096))
    return h.hexdigest()[:16]


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


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
    branches: Optional[int] = None  # mirror's branch budget B (a file from before budgets has none: every branch)
    why: str = ""
    table: list = field(default_factory=list)  # rows: config fields + predicted / measured tokens/s
    calibration: dict = field(default_factory=dict)  # the measured timings and acceptance, for reading
    version: int = VERSION


def key_for(target: object, draft: object = None, adapter: object = None) -> dict:
    return {"target": fingerprint(target), "draft": fingerprint(getattr(draft, "model", draft)),
            "adapter": fingerprint(adapter), "machine": machine()}


def path_for(key: dict) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"profile-{digest}.json"


def save(profile: Profile) -> Path:
    """Write the profile; ProfileError (and no leftover file) when the cache cannot be written.

    A read-only home, a full disk or MIRROR_MLX_CACHE naming a file must not stop a generation: the
    caller keeps the profile in memory and says once that it was not saved."""
    path = path_for(profile.key)
    tmp = path.with_suffix(".tmp")
    data = json.dumps(asdict(profile), indent=1, default=str)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(data)
        tmp.replace(path)  # atomic: a reader never sees half a profile
    except OSError as e:
        with suppress(OSError):
            tmp.unlink()
        raise ProfileError(f"cannot write the tuning profile to {path.parent} "
                           f"({e.strerror or type(e).__name__}): kept in memory for this process only; "
                           "set MIRROR_MLX_CACHE to a writable folder to keep it") from None
    return path


def saved(key: dict, engine: "Optional[Engine]" = None) -> Optional[Profile]:
    """The profile for `key`, None if there is none; ProfileError if the file is unreadable, or holds
    knobs out of range (for `engine`'s target and draft when given)."""
    path = path_for(key)
    if not path.is_file():
        return None
    try:
        profile = Profile(**json.loads(path.read_text()))
    except OSError as e:
        raise ProfileError(f"the tuning profile {path} cannot be read ({e.strerror or type(e).__name__}): "
                           "fix its permissions, delete it or run `mirror-mlx tune` again") from None
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as e:
        raise ProfileError(f"the tuning profile {path} is corrupt ({type(e).__name__}): "
                           "delete it or run `mirror-mlx tune` again") from None
    if profile.version != VERSION or profile.key != key or profile.mode not in MODES:
        raise ProfileError(f"the tuning profile {path} does not match this model pair, machine or version: "
                           "delete it or run `mirror-mlx tune` again")
    bad = _out_of_range(profile) or (engine is not None and _unusable(profile, engine))
    if bad:
        raise ProfileError(f"the tuning profile {path} holds {bad}, out of range: "
                           "delete it or run `mirror-mlx tune` again")
    return profile


def _unusable(profile: Profile, engine: "Engine") -> str:
    """Why the engine would refuse the profile's choice (γ beyond the draft's context, ℓe beyond the
    target's layers), or ""."""
    if profile.mode == "recycle":  # the recycled tree: no knob of its own, any target runs it
        return ""
    opts = DecodeOptions(mode=profile.mode, kappa=profile.kappa, gamma=profile.gamma, exit_layer=profile.exit_layer,
                         branches=profile.branches)
    try:
        decode_options(opts, ("mirror", "sd", "ar"), engine.vocab_size, engine.n_layers, engine.draft_context)
    except (TypeError, ValueError) as e:
        return f"a choice this model pair cannot run ({e})"
    return ""


def _out_of_range(profile: Profile) -> str:
    """What in a profile's choice no run could use ("" when nothing): an edited or damaged file."""
    for name in ("kappa", "gamma", "exit_layer", "branches"):
        value = getattr(profile, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"{name}: {value!r} (must be an int of at least 1)"
    if profile.mode == "mirror" and profile.kappa is not None and profile.gamma is not None and (
            profile.kappa * (profile.gamma + 1) > MAX_BRANCHES or profile.gamma >= 512):
        return (f"kappa: {profile.kappa}, gamma: {profile.gamma} (kappa*(gamma+1) must be at most "
                f"{MAX_BRANCHES})")
    return ""


def row_cost(profile: Optional[Profile]) -> Optional[float]:
    """A verify's cost per row past the first, in one-row forwards, from the profile's measured verify widths
    (the least-squares slope of their cost over a one-row forward's); None without a measured one."""
    if profile is None:
        return None
    verify = ((profile.calibration or {}).get("timings") or {}).get("verify") or {}
    widths = {int(rows): seconds for rows, seconds in verify.items()}
    one = widths.get(1)
    points = [(r - 1, t / one - 1.0) for r, t in widths.items() if r > 1] if one else []
    if not points:
        return None
    return max(0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points))


@dataclass
class AutoState:
    """One pipeline's mode auto: its profile (None until first needed), the profile's key, and what auto's
    runs have seen, per sampling setting (DecodeOptions.sampling) and configuration (`ConfigKey`)."""

    profile: Optional[Profile] = None
    key: Optional[dict] = None
    seen: dict[tuple, dict[tuple, list]] = field(default_factory=dict)  # policy.ConfigKey → policy.Counts
    placement_held: str = ""  # a caller pins threads itself (how, in words): placement.py leaves them alone
    placement_forced: Optional[str] = None  # tune's runs: every generation in this placement (placement.py)
    proposer_forced: str = ""  # tune's runs of the recycled tree beside a model draft: the proposer they name


class PairView(Protocol):
    """A loaded pair as tune reads it (a Pipeline is one; tune imports nothing of it): its models, its engine's
    doors, mode auto's state, the lock a measurement holds, and a generation to time."""

    model: "nn.Module"
    draft: "Union[Draft, DraftRecipe, None]"
    tokenizer: "TokenizerWrapper"
    engine: "Engine"
    lock: "threading.Lock"

    @property
    def auto(self) -> AutoState: ...

    def encode(self, prompt: str) -> list[int]: ...

    def generate(self, prompt: Union[str, Sequence[int]], prompt_cache: None = None,
                 **options: object) -> "Result": ...


def pipe_key(pipe: PairView) -> dict:
    """The pair's profile key, with a caller's own pinning (placement.hold) and across ranks the rank count in
    it (the target's fingerprint is then rank 0's shard): a profile never serves another pinning or rank count."""
    if pipe.auto.key is None:
        pipe.auto.key = key_for(pipe.model, pipe.draft, pipe.engine.exit_adapter)
        if pipe.auto.placement_held:
            pipe.auto.key["placement"] = pipe.auto.placement_held
        group = getattr(pipe, "group", None)
        if group is not None:
            pipe.auto.key["ranks"] = group.size()
    return pipe.auto.key
