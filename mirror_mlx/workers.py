"""Worker threads that own a model and its MLX stream, and the scheduler's event-loop thread.

MLX streams and lazy graphs are thread-affine: each worker builds *and* evaluates its graphs on
its own OS thread, and only Python values or evaluated arrays leave it. (Two such threads do not
compute at the same time inside one process, docs/design.md §4: the draft runs in its own process.)
"""

import asyncio
import atexit
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Optional

import mlx.core as mx

_live: "weakref.WeakSet[Worker]" = weakref.WeakSet()


def wait_os_thread_gone(native_id: Optional[int], cap: float = 2.0) -> None:
    """`join` returns before the OS thread runs MLX's thread-local destructors, which take the GIL;
    if the interpreter finalizes meanwhile, the process aborts. On Linux, wait for the task to go."""
    task = f"/proc/self/task/{native_id}"
    end = time.monotonic() + cap
    while native_id is not None and os.path.exists(task) and time.monotonic() < end:
        time.sleep(0.002)


def _close_all() -> None:
    """Stop worker threads while the interpreter is still whole (else MLX aborts at exit)."""
    for worker in list(_live):
        worker.close()


atexit.register(_close_all)


class Worker:
    """One OS thread with its own MLX stream; jobs run there one at a time, in order."""

    def __init__(self, name: str):
        self.name = name
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mirror-{name}")
        self.stream = self._pool.submit(lambda: mx.new_stream(mx.default_device())).result()
        _live.add(self)

    def submit(self, fn: Callable, *args: Any) -> Future:
        return self._pool.submit(self._job, fn, args, False)

    def _job(self, fn: Callable, args: tuple, timed: bool) -> Any:
        with mx.stream(self.stream):
            if not timed:
                return fn(*args)
            t0 = time.perf_counter()
            out = fn(*args)
            return out, t0, time.perf_counter()

    def call(self, fn: Callable, *args: Any) -> Any:
        """Run `fn(*args)` on the worker thread and wait for it."""
        return self.submit(fn, *args).result()

    async def run(self, fn: Callable, *args: Any) -> tuple[Any, float, float]:
        """Await `fn(*args)` on the worker; returns (result, start, end) perf_counter timestamps."""
        return await asyncio.wrap_future(self._pool.submit(self._job, fn, args, True))

    def close(self, join_timeout: float = 10.0) -> None:
        """Stop the thread; wait up to `join_timeout` s for a job still running (a stalled draft)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for thread in list(getattr(self._pool, "_threads", ())):
            thread.join(join_timeout)
            wait_os_thread_gone(thread.native_id)
        _live.discard(self)


async def _boxed(coro) -> tuple[bool, Any]:
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
    """

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro) -> Any:
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
