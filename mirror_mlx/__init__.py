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
