"""mirror-mlx: Mirror Speculative Decoding with an MLX target and an (ANE) draft."""

import os

from .blas import preload_openblas

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" banner

preload_openblas()  # before anything imports mlx.core

__version__ = "0.1.0"


def load(*args, **kwargs):
    """Load a target (and draft): see `mirror_mlx.pipeline.load`."""
    from .pipeline import load as _load

    return _load(*args, **kwargs)


def generate(model, tokenizer, prompt, verbose=False, **kwargs):
    """mlx_lm.generate's signature, Mirror-SD underneath: see `mirror_mlx.mlx_lm_api.generate`."""
    from .mlx_lm_api import generate as _generate

    return _generate(model, tokenizer, prompt, verbose=verbose, **kwargs)


def stream_generate(model, tokenizer, prompt, max_tokens=256, draft_model=None, **kwargs):
    """mlx_lm.stream_generate's signature, Mirror-SD underneath: see `mirror_mlx.mlx_lm_api.stream_generate`."""
    from .mlx_lm_api import stream_generate as _stream_generate

    return _stream_generate(model, tokenizer, prompt, max_tokens, draft_model, **kwargs)
