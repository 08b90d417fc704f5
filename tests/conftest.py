import mirror_mlx  # noqa: F401  (preload OpenBLAS before any test imports mlx.core)

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def tuning_cache(tmp_path_factory):
    """mode="auto" calibrates a pair once per session into a throwaway cache (never the user's)."""
    path = tmp_path_factory.mktemp("mirror-mlx-cache")
    old = os.environ.get("MIRROR_MLX_CACHE")
    os.environ["MIRROR_MLX_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("MIRROR_MLX_CACHE", None)
    else:
        os.environ["MIRROR_MLX_CACHE"] = old
