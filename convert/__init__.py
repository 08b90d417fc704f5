"""Builders: llama2.c checkpoints to MLX folders, widening, MLX drafts to Core ML packages.

Installed as `mirror_mlx.convert`; the runtime never imports it."""
