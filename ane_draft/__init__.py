"""The draft side: Speculative-Streaming draft, its training, and the Core ML (ANE) backend."""

import mirror_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)
