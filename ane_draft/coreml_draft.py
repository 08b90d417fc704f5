"""The Core ML draft on macOS 15+: the package runs on the Neural Engine inside the draft host.

`MLModel.predict` holds the GIL for the whole call, so the package lives in the draft host process
(mirror_mlx/drafts/host.py), driven by package_host.PackageDraft with compute units CPU_AND_NE and one
shared `make_state()` KV cache. Off macOS 15+ `coreml_recipe` raises CoreMLUnavailable at once; backend
'mil' runs the same host with the MIL evaluator.
"""

import json
import platform
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Optional

import numpy as np

from mirror_mlx.drafts.recipes import DraftRecipe
from mirror_mlx.ane_draft.package_format import ConvertError, read_metadata, tokenizer_sha256, vocab_sha256
from mirror_mlx.ane_draft.package_host import PackageDraft
from mirror_mlx.drafts.tokenizer import note_special_difference, special_difference

if TYPE_CHECKING:
    from mirror_mlx.ane_draft.package_host import PackageDraft, Runner
    from mlx_lm.tokenizer_utils import TokenizerWrapper

MESSAGE = "Core ML runs on macOS 15+; use the MLX draft folder here"


class CoreMLUnavailable(RuntimeError):
    """Core ML cannot run on this machine (not macOS 15+, or coremltools without its runtime)."""


def coreml_available() -> bool:
    """True on macOS 15+ with coremltools' native runtime importable."""
    if sys.platform != "darwin":
        return False
    try:
        if int(platform.mac_ver()[0].split(".")[0]) < 15:
            return False
        from coremltools import libcoremlpython  # noqa: F401  (coremltools: an extra off macOS)
    except Exception:  # noqa: BLE001
        return False
    return True


class CoreMLRunner:
    """The package's two functions under Core ML, sharing one KV state (macOS 15+ only)."""

    def __init__(self, package: Path):
        import coremltools as ct  # (coremltools: an extra off macOS)

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


def package_draft(package: str, backend: str = "coreml") -> "PackageDraft":
    """Runs in the draft host: the package's functions under `backend` behind the Draft protocol."""
    runner: "Runner"
    if backend == "coreml":
        runner = CoreMLRunner(Path(package))
    elif backend == "mil":
        from mirror_mlx.convert.mil_eval import MilRunner  # (backend mil: no convert/ at start)

        runner = MilRunner(Path(package))
    else:
        raise ValueError(f"unknown draft backend {backend!r} (use 'coreml' or 'mil')")
    return PackageDraft(runner, read_metadata(Path(package)))


def coreml_recipe(package: Path, tokenizer: "Optional[TokenizerWrapper]" = None,
                  backend: str = "coreml") -> DraftRecipe:
    """How the draft host runs a `.mlpackage`; with the target's tokenizer, a package built for another
    vocabulary is refused up front."""
    if backend == "coreml" and not coreml_available():
        raise CoreMLUnavailable(MESSAGE)
    package = Path(package)
    meta = read_metadata(package)
    if tokenizer is not None:
        check_package_tokenizer(meta, tokenizer, package)
    return DraftRecipe(package_draft, (str(package), backend))


def check_package_tokenizer(meta: dict[str, str], tokenizer: "TokenizerWrapper", package: Path) -> None:
    """mirror_mlx.loading's rule for a draft folder, from what the package recorded: another vocabulary
    is refused, differing special ids are said once (a package with only the whole hash must match it)."""
    whole = "vocab_sha256" not in meta  # a package that recorded only the whole hash
    key, digest = ("tokenizer_sha256", tokenizer_sha256) if whole else ("vocab_sha256", vocab_sha256)
    if meta[key] != digest(tokenizer):
        raise ConvertError(
            f"{package} was built for another tokenizer than the target's; "
            "convert a draft that shares the target's tokenizer"
        )
    if not whole:
        recorded = SimpleNamespace(eos_token_ids=json.loads(meta["eos_token_ids"]),
                                   bos_token_id=json.loads(meta["bos_token_id"]))
        note_special_difference(special_difference(tokenizer, recorded), package)
