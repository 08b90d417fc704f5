"""The draft side: the draft host process, its ring and wire format (host.py, ring.py), the
Speculative-Streaming draft and its training, and the Core ML (ANE) backend.

Installed as `mirror_mlx.ane_draft`."""
