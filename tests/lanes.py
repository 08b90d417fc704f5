"""Independent generations spread over pipelines that run side by side.

A mirror or sd generation keeps about one core busy at a time: the target's worker and the draft's
host process take turns, and with many branches the host alone is the bottleneck while the target
waits. On a 2-core box a second pipeline, with its own draft host process, working through other
prompts meanwhile keeps the other core busy. Every generation is still run and checked; only the
order in which they run changes.
"""

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

LANES = 2  # the CI box's cores


def in_lanes(pipes: Sequence[Any], items: Sequence[Any], fn: Callable[[Any, Any], Any]) -> list:
    """[fn(pipe, item) for item in items], the items dealt in turn to the pipes, one thread per pipe.

    A failure in either lane (an assertion in `fn`) is raised here, once both lanes have stopped."""
    n = len(pipes)
    with ThreadPoolExecutor(n, thread_name_prefix="lane") as pool:
        lanes = [pool.submit(lambda i: [fn(pipes[i], item) for item in items[i::n]], i) for i in range(n)]
        done = [lane.result() for lane in lanes]
    out: list = [None] * len(items)
    for i, results in enumerate(done):
        out[i::n] = results
    return out
