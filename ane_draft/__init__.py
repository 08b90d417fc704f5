"""The draft side: Speculative-Streaming draft, its training, and the Core ML (ANE) backend.

Installed as `mirror_mlx.ane_draft`."""
