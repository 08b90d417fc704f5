import mirror_mlx  # noqa: F401  (preload OpenBLAS before any test imports mlx.core)
