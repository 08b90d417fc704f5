"""Builders: llama2.c checkpoints to MLX folders, widening, MLX drafts to Core ML packages.

Installed as `mirror_mlx.convert`. The runtime imports none of it at start; a draft run with backend
'mil' (ane_draft/coreml_draft.py, the Linux parity checks) evaluates its package with `mil_eval`."""
