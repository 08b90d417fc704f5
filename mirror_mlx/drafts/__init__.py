"""The drafts and their host: the draft protocol (api.py), the plain MLX draft (mlx_draft.py), the
Speculative-Streaming draft (ss/), the distilled draft (distilled/), a trimmed head for any draft (vocab.py),
a draft's tokenizer against the target's (tokenizer.py), how the host builds each (recipes.py), the draft host
and its process (host.py, host_process.py) and the ring between them (ring.py). The Core ML (ANE) backend
lives in mirror_mlx.ane_draft; the SS draft's training in mirror_mlx.train."""
