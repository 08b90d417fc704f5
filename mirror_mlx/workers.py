"""Worker threads that own a model and its MLX stream.

MLX streams and lazy graphs are thread-affine: each worker builds *and* evaluates its graphs on
its own OS thread, and only Python values or evaluated arrays leave it. `mx.eval` releases the
GIL, so a target worker and a draft worker really compute at the same time.
"""

import asyncio
import atexit
import os
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import mlx.core as mx

_live: "weakref.WeakSet[Worker]" = weakref.WeakSet()


def _wait_os_thread_gone(native_id: Optional[int], cap: float = 2.0) -> None:
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
        def job():
            with mx.stream(self.stream):
                return fn(*args)

        return self._pool.submit(job)

    def call(self, fn: Callable, *args: Any) -> Any:
        """Run `fn(*args)` on the worker thread and wait for it."""
        return self.submit(fn, *args).result()

    async def run(self, fn: Callable, *args: Any) -> tuple[Any, float, float]:
        """Await `fn(*args)` on the worker; returns (result, start, end) perf_counter timestamps."""

        def timed():
            t0 = time.perf_counter()
            out = fn(*args)
            return out, t0, time.perf_counter()

        return await asyncio.wrap_future(self.submit(timed))

    def close(self, join_timeout: float = 10.0) -> None:
        """Stop the thread; wait up to `join_timeout` s for a job still running (a stalled draft)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for thread in list(getattr(self._pool, "_threads", ())):
            thread.join(join_timeout)
            _wait_os_thread_gone(thread.native_id)
        _live.discard(self)
