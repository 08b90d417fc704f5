"""What a mirror-mlx Core ML package records about itself: format, static shapes, metadata, tokenizer hash.

The runtime side (the package host, the Core ML draft) reads packages through this module only; the
builder (convert/coreml.py) writes them and imports these definitions from here, so the runtime never
imports the builder.
"""

import base64
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

FORMAT = "1"
META = "mirror_mlx."
NEG = -1.0e4  # additive mask value: exp(-1e4) == 0 in fp16 and fp32, never -inf (no NaN rows)


class ConvertError(ValueError):
    """A draft or package that cannot be converted or used (the message says why and what to do)."""


@dataclass
class Shapes:
    """The static shapes of a package (recorded in its metadata)."""

    context: int  # S: committed slots
    chunk: int  # E: rows per extend call
    rows: int  # B: rows per rollout call
    scratch: int  # W: scratch slots for rollout rows
    kappa: int
    gamma: int
    streams: int = 0  # stream rows per main rollout row (Speculative-Streaming drafts)

    @property
    def slots(self) -> int:
        return self.context + self.scratch

    @classmethod
    def make(cls, context: int, kappa: int, gamma: int, chunk: int = 16, streams: int = 0) -> "Shapes":
        """B = kappa*(gamma+1) rows (times 1 + streams for an SS draft, whose branches each feed
        a main token and its stream guesses per forward); scratch for gamma+1 rollout calls."""
        if kappa < 1 or gamma < 1:
            raise ConvertError(f"kappa and gamma must be >= 1 (got kappa={kappa}, gamma={gamma})")
        if chunk < 1 or context < chunk:
            raise ConvertError(
                f"--context {context} must be at least the extend chunk ({chunk}); use --context >= {chunk}"
            )
        rows = kappa * (gamma + 1) * (1 + streams)
        return cls(context, chunk, rows, rows * (gamma + 1), kappa, gamma, streams)


def tokenizer_sha256(tokenizer: "TokenizerWrapper") -> str:
    """A hash of the vocabulary (token -> id) and special ids: equal hashes, interchangeable ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = [getattr(tokenizer, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")]
    blob = json.dumps([vocab, special], ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()


def vocab_sha256(tokenizer: "TokenizerWrapper") -> str:
    """A hash of the vocabulary alone (token -> id): what a target and its draft must share."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def tokenizer_metadata(tokenizer: "TokenizerWrapper") -> dict[str, str]:
    """What a package records of its draft's tokenizer: the whole hash (checked against its draft folder),
    and the vocabulary's hash and special ids as mlx_lm.load loads them (checked against a target)."""
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or ())
    return {"tokenizer_sha256": tokenizer_sha256(tokenizer), "vocab_sha256": vocab_sha256(tokenizer),
            "eos_token_ids": json.dumps(eos), "bos_token_id": json.dumps(getattr(tokenizer, "bos_token_id", None))}


def kept_ids_metadata(kept: np.ndarray, vocab: int) -> str:
    """A trimmed head's kept ids (ascending) as the package records them: a base64 bitmask over the vocabulary
    (a few KB however many ids are kept; 25 KB for 151,936 ids)."""
    bits = np.zeros(vocab, dtype=bool)
    bits[np.asarray(kept, dtype=np.int64)] = True
    return base64.b64encode(np.packbits(bits).tobytes()).decode()


def read_kept_ids(meta: dict[str, str]) -> Optional[np.ndarray]:
    """The ids a package's logit columns stand for, ascending (int64), or None when its head is the whole
    vocabulary: column j of every logit row is the score of token id kept[j]."""
    if "kept_ids" not in meta:
        return None
    bits = np.unpackbits(np.frombuffer(base64.b64decode(meta["kept_ids"]), dtype=np.uint8), count=int(meta["vocab"]))
    return np.flatnonzero(bits)


def import_coremltools() -> ModuleType:
    """coremltools, or a ConvertError naming the fix: off macOS it is the `convert` extra."""
    try:
        import coremltools  # (coremltools: an extra off macOS)
    except ImportError:
        raise ConvertError("coremltools is not installed, and building, checking or reading a Core ML draft package "
                           "needs it: pip install 'mirror-mlx[convert]' (on macOS it comes with mirror-mlx)") from None
    return coremltools


def read_metadata(package: Path) -> dict[str, str]:
    """The package's mirror-mlx metadata (prefix stripped); a clear error if it is not ours or broken."""
    ct = import_coremltools()

    package = Path(package)
    if not package.exists():
        raise ConvertError(f"{package} does not exist "
                           f"(build it with `mirror-mlx convert --draft-model DIR --out {package.name}`)")
    try:
        spec = ct.utils.load_spec(str(package))
    except Exception as e:  # noqa: BLE001  (protobuf/IO errors of many kinds)
        raise ConvertError(
            f"{package} is not a readable Core ML package ({type(e).__name__}: {e}); "
            "it is corrupt or truncated: rebuild it with `mirror-mlx convert`"
        ) from None
    meta = dict(spec.description.metadata.userDefined)
    if meta.get(META + "format") != FORMAT:
        raise ConvertError(f"{package} was not built by `mirror-mlx convert` (format {FORMAT}); rebuild it")
    return {k[len(META):]: v for k, v in meta.items() if k.startswith(META)}


def package_shapes(meta: dict[str, str]) -> Shapes:
    keys = ("context", "chunk", "rows", "scratch", "kappa", "gamma")
    return Shapes(**{k: int(meta[k]) for k in keys}, streams=int(meta.get("streams", 0)))
