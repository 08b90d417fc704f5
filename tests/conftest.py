import mirror_mlx  # noqa: F401  (preload OpenBLAS before any test imports mlx.core)

import os
from multiprocessing import shared_memory

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


@pytest.fixture
def shm_made(monkeypatch):
    """The names of every shared-memory block created during the test (other processes' /dev/shm
    entries are not ours to count on a shared machine)."""
    made = []
    real = shared_memory.SharedMemory

    class Spy(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self.name)

    monkeypatch.setattr(shared_memory, "SharedMemory", Spy)
    return made


def leftover(names):
    """Those of `names` still in /dev/shm."""
    return [n for n in names if os.path.exists(f"/dev/shm/{n.lstrip('/')}")]
