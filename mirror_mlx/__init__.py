"""mirror-mlx: Mirror Speculative Decoding with an MLX target and an (ANE) draft.

`import mirror_mlx` does one thing beyond defining names, on Linux only: it loads a tuned BLAS globally before
anything imports `mlx.core` (mirror_mlx/blas.py, docs/cpu.md). MLX binds its BLAS when it loads, and neither MLX
nor mlx-lm has a hook for it later; `MIRROR_MLX_BLAS=none` turns it off. Everything else loads on first use.
"""

from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

from .blas import preload as preload_blas

if TYPE_CHECKING:  # the real import is deferred: `import mirror_mlx` stays cheap
    from .pipeline import Pipeline

__all__ = ["__version__", "generate", "load", "stream_generate"]

preload_blas()  # before anything imports mlx.core

__version__ = "0.1.0"


def load(model: Optional[Union[str, Path]] = None, draft_model: Optional[Union[str, Path]] = None,
         exit_adapter: Optional[Union[str, Path]] = None, *, adapter_path: Optional[Union[str, Path]] = None,
         tokenizer_config: Optional[dict] = None, trust_remote_code: bool = False,
         draft_vocab: Optional[int] = None) -> "Pipeline":
    """Load a target and its draft; with no model, the embedded demo pair (offline). See
    `mirror_mlx.pipeline.load`."""
    from .pipeline import load as _load  # (`import mirror_mlx` loads no pipeline)

    return _load(model, draft_model, exit_adapter, adapter_path=adapter_path, tokenizer_config=tokenizer_config,
                 trust_remote_code=trust_remote_code, draft_vocab=draft_vocab)


def generate(model, tokenizer, prompt, verbose=False, **kwargs):
    """mlx_lm.generate's signature, Mirror-SD underneath: see `mirror_mlx.mlx_lm_api.generate`."""
    from .mlx_lm_api import generate as _generate  # (`import mirror_mlx` loads no pipeline)

    return _generate(model, tokenizer, prompt, verbose=verbose, **kwargs)


def stream_generate(model, tokenizer, prompt, max_tokens=256, draft_model=None, **kwargs):
    """mlx_lm.stream_generate's signature, Mirror-SD underneath: see `mirror_mlx.mlx_lm_api.stream_generate`."""
    from .mlx_lm_api import stream_generate as _stream_generate  # (`import mirror_mlx` loads no pipeline)

    return _stream_generate(model, tokenizer, prompt, max_tokens, draft_model, **kwargs)
