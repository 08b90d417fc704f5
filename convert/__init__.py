"""Builders: llama2.c checkpoints to MLX folders, widening, MLX drafts to Core ML packages."""

import mirror_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)
