"""Worker threads that own a model and its MLX stream, and the scheduler's event-loop thread.

MLX streams and lazy graphs are thread-affine: each worker builds *and* evaluates its graphs on
its own OS thread, and only Python values or evaluated arrays leave it. (Two such threads do not
compute at the same time inside one process, docs/design.md §4: the draft runs in its own process.)
"""

import asyncio
import atexit
import os
import queue
import threading
import time
import weakref
from concurrent.futures import Future, wait
from functools import partial
from typing import Any, Callable, Coroutine, TypeVar

import mlx.core as mx

T = TypeVar("T")

_live: "weakref.WeakSet[Worker]" = weakref.WeakSet()


class _MLXThread:
    """A daemon OS thread that runs MLX jobs and never exits: when its Worker closes it parks, to serve the next.

    Why it never exits: MLX keeps per-thread state (the `mx.compile` cache) whose destructor, run when
    the OS thread ends, takes the GIL. A thread ending while the interpreter finalizes is stopped
    inside that destructor by CPython, and C++ calls std::terminate: SIGABRT at exit ("terminate called
    without an active exception"). A parked thread never runs it: the process ends around it.
    """

    def __init__(self):
        self.jobs: "queue.SimpleQueue[tuple[Future, Callable]]" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="mirror-mlx", daemon=True)
        self.thread.start()
        self.stream = self.do(lambda: mx.new_stream(mx.default_device())).result()  # this thread's, for good

    def do(self, fn: Callable) -> Future:
        future: Future = Future()
        self.jobs.put((future, fn))
        return future

    def _serve(self) -> None:
        while True:
            future, fn = self.jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the caller's to handle, as a ThreadPoolExecutor does
                future.set_exception(e)
            del future, fn


_idle: list[_MLXThread] = []  # parked, for the next Worker
_idle_lock = threading.Lock()
os.register_at_fork(after_in_child=_idle.clear)  # (a forked child has none of these threads)


def _park(mlx: _MLXThread) -> None:
    with _idle_lock:
        _idle.append(mlx)


def _close_all() -> None:
    """At exit: let every job still running end while the interpreter is whole (then its thread parks)."""
    for worker in list(_live):
        worker.close()


atexit.register(_close_all)


class Worker:
    """One OS thread with its own MLX stream; jobs run there one at a time, in order.

    The thread and its stream are reused by later Workers once this one closes (see _MLXThread).
    """

    def __init__(self, name: str):
        self.name = name
        with _idle_lock:
            parked = _idle.pop() if _idle else None
        self._mlx = parked if parked is not None else _MLXThread()
        self._mlx.thread.name = f"mirror-{name}"
        self.thread, self.stream = self._mlx.thread, self._mlx.stream
        self._pending: "weakref.WeakSet[Future]" = weakref.WeakSet()
        self._closed = False
        # dropped without close: the thread parks once the jobs queued before are done
        self._dropped = weakref.finalize(self, self._mlx.do, partial(_park, self._mlx))
        self._dropped.atexit = False  # at exit a parked thread must stay parked: a job then could end it
        _live.add(self)

    def submit(self, fn: Callable[..., T], *args: object) -> "Future[T]":
        if self._closed:
            raise RuntimeError(f"worker {self.name!r} is closed")

        def job():
            with mx.stream(self.stream):
                return fn(*args)

        future = self._mlx.do(job)
        self._pending.add(future)
        return future

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on the worker thread and wait for it."""
        return self.submit(fn, *args).result()

    async def run(self, fn: Callable[..., T], *args: object) -> tuple[T, float, float]:
        """Await `fn(*args)` on the worker; returns (result, start, end) perf_counter timestamps."""

        def timed():
            t0 = time.perf_counter()
            out = fn(*args)
            return out, t0, time.perf_counter()

        return await asyncio.wrap_future(self.submit(timed))

    def close(self, join_timeout: float = 10.0) -> None:
        """Cancel queued jobs, wait up to `join_timeout` s for one still running (a stalled draft), then
        park the thread for reuse. A thread still busy after that is left to finish and park on its own."""
        if self._closed:
            return
        self._closed = True
        self._dropped.detach()
        _live.discard(self)
        for future in list(self._pending):
            future.cancel()
        if wait([self._mlx.do(lambda: None)], join_timeout).done:
            _park(self._mlx)


async def _boxed(coro: Coroutine[object, object, T]) -> tuple[bool, Any]:
    """(raised, value): a KeyboardInterrupt or SystemExit from a worker thread comes back to the caller
    as a value; raised inside the loop it would stop the loop for good (asyncio re-raises them)."""
    try:
        return False, await coro
    except (KeyboardInterrupt, SystemExit) as e:
        return True, e


class LoopThread:
    """One asyncio event loop on its own thread: the scheduler's, for the engine's whole life.

    `run(coro)` blocks the calling thread until the coroutine is done, so the synchronous API works
    even from inside another running event loop (an async app); one loop, not one per generation.
    It never computes with MLX (the workers do), so it may end at any time, exit included (_MLXThread).
    """

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[object, object, T]) -> T:
        if self.loop.is_closed():
            coro.close()
            raise RuntimeError("the engine is closed")
        job = asyncio.run_coroutine_threadsafe(_boxed(coro), self.loop)
        try:
            raised, value = job.result()
        except BaseException:  # e.g. Ctrl-C here: let the step end (caches and host stay in step), then raise
            wait([job])
            raise
        if raised:
            raise value
        return value

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self.loop.close()
