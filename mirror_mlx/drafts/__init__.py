"""The drafts and their host: the plain MLX draft (mlx_draft.py), the Speculative-Streaming draft and its
model (ss_draft.py, ss_model.py), how the host builds each (recipes.py), the draft host and its process
(host.py, host_process.py) and the ring between them (ring.py). The Core ML (ANE) backend and the SS
draft's training live in mirror_mlx.ane_draft."""
