"""A server across ranks: rank 0 serves HTTP with its pipeline `leading`; the other ranks run no server
and `follow` it, step by step."""

import json
import signal
import threading
import time
from typing import TYPE_CHECKING, Generator, Optional

from ..chunks import Chunk
from .faults import collective, die, end_with_launcher, stop_within_grace
from .group import share
from .pipeline import IDLE, IDLE_SLEEP_S, MESSAGE, QUIT, RESET, START, STEP, STOP, DistributedPipeline, held

if TYPE_CHECKING:
    from ..server.prefix_cache import PrefixCache


def follow(pipe: DistributedPipeline, prefixes: "Optional[PrefixCache]" = None) -> None:
    """Ranks > 0 of a server: run what rank 0 (`DistributedPipeline.leading`) runs, step by step, until it
    ends. Waiting for the next request is no stall (no watchdog); within a request rank 0 is timed.
    `prefixes`: this rank's PrefixCache, restored and stored where rank 0's scheduler does (before a request;
    after one that ended by itself), so it holds what rank 0's holds, for this rank's shard."""
    g = pipe.group
    stream: Optional[Generator[Chunk, None, None]] = None
    stepped = False  # a step of `stream` ran
    failed: Optional[BaseException] = None

    def receive(size: int, what: Optional[str]) -> list[int]:
        with pipe.watchdog.waiting(what):
            return collective(lambda: share([], size, g))

    def end() -> None:
        nonlocal stream, stepped
        stepped = False
        if stream is not None:
            s, stream = stream, None
            s.close()

    while True:
        kind, a, b, *cache = receive(MESSAGE, None if stream is None else "rank 0's next step")
        if kind == QUIT:
            end()
            return
        if kind == IDLE:  # no request runs: wait for rank 0's next tick asleep, not in the ring's polling receive
            time.sleep(IDLE_SLEEP_S)
            continue
        if kind == START:
            if stepped:  # (rank 0 ends every request it stepped: the same finished chunk, or STOP)
                die("rank 0 started a request while this rank was still in one: stopping")
            end()  # (one whose start failed on rank 0 alone: no step of it ran)
            got = receive(a + b, "rank 0's request")
            failed = None
            if prefixes is not None:
                prefixes.restore(got[:a])
            if held(pipe) != cache:
                die(f"before this request rank {g.rank()}'s target cache holds {held(pipe)[0]} tokens and rank 0's "
                    f"{cache[0]} (or other ones): the ranks diverged: stopping")
            try:
                stream = pipe.stream(got[:a], **json.loads(bytes(got[a:])))
            except Exception as e:  # noqa: BLE001 - rank 0 refuses it alike (the same check on the same input)
                failed = e
        elif kind == STEP:
            if stream is None:
                die(f"rank 0 runs a request this rank could not start ({failed!r}): stopping")
            assert stream is not None  # (die ended the process)
            stepped = True
            try:
                chunk = next(stream, None)
            except Exception as e:  # noqa: BLE001 - rank 0's step fails alike; it says STOP, then RESET
                stream, stepped, failed = None, False, e
                continue
            if chunk is None or chunk.finish_reason is not None:
                end()
                if prefixes is not None:
                    prefixes.store()
        elif kind == STOP:
            end()
        elif kind == RESET:
            end()
            pipe.reset()
        else:
            die(f"rank 0 sent {[kind, a, b]}, no message a server's rank knows (a different mirror-mlx on each "
                "rank?): stopping")


def serve_follower(pipe: DistributedPipeline, prefixes: "Optional[PrefixCache]" = None) -> None:
    """`mirror-mlx serve` on ranks > 0: no server, only `follow`. SIGINT/SIGTERM/SIGHUP or the launcher
    gone: rank 0 got it too and ends the run (QUIT); if it has not in GRACE_S s, this rank ends alone."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop_within_grace)
    end_with_launcher()

    def run() -> None:
        try:
            follow(pipe, prefixes)
        except BaseException as e:  # noqa: BLE001 - this rank cannot go on in step with rank 0
            die(f"{type(e).__name__}: {e}: stopping")

    thread = threading.Thread(target=run, name="mirror-follower", daemon=True)
    thread.start()
    while thread.is_alive():  # (the main thread stays free for the signal handlers)
        thread.join(0.5)
