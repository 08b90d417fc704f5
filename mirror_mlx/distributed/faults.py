"""Faults across ranks: one line and out. MLX's collectives block, so a lost or stalled peer must not hang
a rank: a watchdog times every wait, a lost peer ends the rank, and a signal or a vanished launcher ends
it too, each time with its draft hosts ended and its shared memory unlinked."""

import os
import signal
import threading
import time
from contextlib import contextmanager, suppress
from types import FrameType
from typing import Callable, Iterator, Optional, TypeVar

from ..drafts.host import close_all
from .group import rank

T = TypeVar("T")
TIMEOUT_ENV = "MIRROR_MLX_DIST_TIMEOUT"
GRACE_S = 10.0  # a rank told to stop (a server's, or Ctrl-C on a run) ends within this long (stop_within_grace)

_dying = threading.Lock()


class Diverged(RuntimeError):
    """Two ranks hold different committed tokens (never expected: the ranks reduce to the same bits)."""


def die(message: str, code: int = 1) -> None:
    """One line on stderr, every draft host of this process ended and its shared memory unlinked, exit.
    (os._exit: a thread blocked in a collective would keep a normal exit waiting forever.)"""
    if not _dying.acquire(blocking=False):  # already ending (say, SIGTERM while a lost peer is said): one line
        return
    try:
        os.write(2, f"mirror-mlx: rank {rank()}: {message}\n".encode())
        close_all()
    finally:
        os._exit(code)


class Watchdog:
    """Ends the process when a collective waits longer than `timeout` s: MLX's collectives block, and a
    peer that stalls (alive, but not answering) would otherwise hang every rank."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.what: Optional[str] = None
        self.since = 0.0
        self.lock = threading.Lock()
        threading.Thread(target=self._watch, name="mirror-watchdog", daemon=True).start()

    @contextmanager
    def waiting(self, what: Optional[str]) -> Iterator[None]:
        """A wait the watchdog times (None: one it does not); nested ones restore the outer wait, its clock
        started over."""
        with self.lock:
            outer, self.what, self.since = self.what, what, time.monotonic()
        try:
            yield
        finally:
            with self.lock:
                self.what, self.since = outer, time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            with self.lock:
                late = self.what is not None and time.monotonic() - self.since > self.timeout
                what = self.what
            if late:
                die(f"no answer from the other ranks in {self.timeout:g} s while waiting for {what} "
                    f"(a rank stalled or its host is unreachable; {TIMEOUT_ENV} sets the limit): stopping")

    def beat(self) -> None:
        """Progress (a prefill chunk done): the wait in course starts over."""
        with self.lock:
            self.since = time.monotonic()


def on_stop_signal(signum: int, frame: Optional[FrameType]) -> None:
    """SIGTERM or SIGHUP ends this rank with one line (`die`)."""
    die(f"stopped by {signal.Signals(signum).name} (mlx.launch stops every rank once one has failed)", 128 + signum)


def on_interrupt(signum: int, frame: Optional[FrameType]) -> None:
    """Ctrl-C ends a rank as it ends one process (the step in course ends, then KeyboardInterrupt, 130),
    within GRACE_S s: a step whose peer has already gone (its own Ctrl-C came between two steps) never
    ends, since the ring waits for it, so the grace timer ends this rank with one line instead."""
    stop_within_grace(signum)
    raise KeyboardInterrupt


def lost_peer(e: BaseException) -> bool:
    """MLX's error when a collective's peer is gone (its ring backend says "[ring] ...")."""
    return isinstance(e, RuntimeError) and "[ring]" in str(e) or isinstance(e, Diverged)


def collective(fn: Callable[[], T]) -> T:
    """Run `fn` (a collective): a lost peer ends this rank with one line instead of an MLX traceback."""
    try:
        return fn()
    except BaseException as e:
        if lost_peer(e):
            die(f"lost a rank of the group ({e}): stopping")
        raise


_grace: list = []


def stop_within_grace(signum: int, frame: Optional[FrameType] = None) -> None:
    """A server's rank asked to stop (SIGINT/SIGTERM/SIGHUP, or its launcher gone) ends within GRACE_S s:
    rank 0 stops as one process does (the step in course ends, the other ranks are told QUIT); a step that
    cannot end (a rank lost or stalled: the ring may wait for it forever) or a rank 0 that never says QUIT
    ends this rank with one line instead."""
    if _grace:
        return
    name = signal.Signals(signum).name
    waited = "the step in course did not end" if rank() == 0 else "rank 0 did not end the run"
    timer = threading.Timer(GRACE_S, die, (f"stopped by {name}; {waited} in {GRACE_S:g} s (a rank lost or "
                                           "stalled?)", 128 + signum))
    timer.daemon = True
    timer.start()
    _grace.append(timer)


def end_with_launcher(interval: float = 0.5) -> None:
    """A rank whose launcher is gone (killed: mlx.launch passes no SIGTERM on) stops as on SIGTERM. Its
    output, which no one reads now, goes to /dev/null (a write would fail)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        with suppress(OSError):
            os.write(2, f"mirror-mlx: rank {rank()}: the launcher is gone: stopping\n".encode())
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="mirror-launcher-watch", daemon=True).start()
