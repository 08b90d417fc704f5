"""The draft's answers on every rank: rank 0 runs the real draft host (`SharedHost`), the other ranks a
stand-in (`MirrorHost`) with the same interface as mirror_mlx/drafts/host.py's DraftHost, and each answer the
engine waits for goes from rank 0 to the others through one `share`, so the engine does not know it is
distributed."""

import time
from typing import Optional, Sequence

import mlx.core as mx

from ..drafts.host import DraftHost, DraftHostError
from ..drafts.api import Rollout
from .faults import Diverged, Watchdog
from .group import share

OK, FAILED = 1, 2  # a reply's first word
HEAD = 5  # [status, len(context), context[-1], forwards, tokens] before the windows


def _tail(context: Sequence[int]) -> list[int]:
    return [len(context), context[-1] if len(context) else -1]


class SharedHost:
    """Rank 0: the real draft host; each answer the engine waits for is also shared with the other ranks.

    A request that fails to post is held and raised at its answer, so every rank sees the failure at the
    same collective (and drops the draft together, as one process would)."""

    def __init__(self, host: DraftHost, g: mx.distributed.Group, watchdog: "Watchdog"):
        self.real, self.group, self.watchdog = host, g, watchdog
        self.local = host  # the host this rank can time alone (tune)
        self.process, self.vocab_size, self.kind = host.process, host.vocab_size, host.kind
        self.failed: Optional[BaseException] = None
        self.n, self.tail = 1, [0, -1]
        # no pid: the cores stay unpinned (tune/placement.py), as on every rank; a profile's placement was
        # measured in one process
        self.pid: Optional[int] = None

    def _post(self, fn, context, *args) -> None:
        self.tail = _tail(context)
        try:
            fn(context, *args)
        except Exception as e:  # noqa: BLE001 - raised at the answer, on every rank alike
            self.failed = e

    def post_sync(self, context: Sequence[int]) -> None:
        self._post(self.real.post_sync, context)

    def post_prepare(self, context: Sequence[int]) -> None:
        tail = self.tail  # (no answer of its own is shared: the ranks compare the next one's context)
        self._post(self.real.post_prepare, context)
        self.tail = tail

    def post_rollout(self, context: Sequence[int], stems: Sequence[Sequence[int]], gamma: int) -> None:
        self.n = len(stems)
        self._post(self.real.post_rollout, context, stems, gamma)

    def post_branches(self, context: Sequence[int], window: Sequence[int], cand: list[list[int]]) -> None:
        self.n = len(cand) * len(cand[0])
        self._post(self.real.post_branches, context, window, cand)

    def _status(self, size: int, values: Sequence[int]) -> None:
        with self.watchdog.waiting("rank 0's draft answer"):
            share(values, size, self.group)

    def _raise_held(self) -> None:
        if self.failed is not None:
            failed, self.failed = self.failed, None
            raise failed

    def _answer(self, wait) -> None:
        try:
            self._raise_held()
            wait()
        except BaseException:
            self._status(HEAD, [FAILED])
            raise
        self._status(HEAD, [OK] + self.tail)

    def wait_done(self, timeout: Optional[float]) -> None:
        self._answer(lambda: self.real.wait_done(timeout))

    def reset(self, timeout: Optional[float] = None) -> None:
        self.tail = [0, -1]
        self._answer(lambda: self.real.reset(timeout))

    async def windows(self, gamma: int) -> tuple[Rollout, float, float]:
        size = HEAD + self.n * gamma
        try:
            self._raise_held()
            out, r0, r1 = await self.real.windows(gamma)
            flat = [t for w in out.windows for t in w]
            if len(flat) != self.n * gamma:
                raise DraftHostError(f"the draft answered {len(flat)} tokens for {self.n} windows of {gamma}")
        except BaseException:  # (a timeout's cancellation too: the other ranks must hear of it)
            self._status(size, [FAILED])
            raise
        self._status(size, [OK] + self.tail + [out.forwards, out.tokens] + flat)
        return out, r0, r1

    def close(self, grace: float = 2.0) -> None:
        self.real.close(grace)

    def kill(self) -> None:
        self.real.kill()


class MirrorHost:
    """Ranks > 0: the draft's stand-in. It posts nothing; each answer is rank 0's, received through the
    same collective. A context that differs from rank 0's means the ranks decided different tokens: that
    rank stops the run (`Diverged`), it never goes on with other text."""

    process = False
    kind = "rank 0's draft"
    local = None  # no draft on this rank to time alone (tune)
    pid: Optional[int] = None  # (tune/placement.py: unpinned)

    def __init__(self, g: mx.distributed.Group, vocab_size: int, watchdog: "Watchdog"):
        self.group, self.vocab_size, self.watchdog = g, vocab_size, watchdog
        self.n, self.tail = 1, [0, -1]

    def post_sync(self, context: Sequence[int]) -> None:
        self.tail = _tail(context)

    def post_prepare(self, context: Sequence[int]) -> None:
        """(rank 0's draft feeds it; nothing is answered for it)"""

    def post_rollout(self, context: Sequence[int], stems: Sequence[Sequence[int]], gamma: int) -> None:
        self.n, self.tail = len(stems), _tail(context)

    def post_branches(self, context: Sequence[int], window: Sequence[int], cand: list[list[int]]) -> None:
        self.n, self.tail = len(cand) * len(cand[0]), _tail(context)

    def _receive(self, size: int) -> list[int]:
        with self.watchdog.waiting("rank 0's draft answer"):
            got = share([], size, self.group)
        if got[0] != OK:
            raise DraftHostError("the draft on rank 0 failed")
        if got[1:3] != self.tail:
            raise Diverged(f"rank {self.group.rank()} holds {self.tail[0]} tokens ending in {self.tail[1]}, "
                           f"rank 0 holds {got[1]} ending in {got[2]}")
        return got

    def wait_done(self, timeout: Optional[float]) -> None:
        self._receive(HEAD)

    def reset(self, timeout: Optional[float] = None) -> None:
        self.tail = [0, -1]
        self._receive(HEAD)

    async def windows(self, gamma: int) -> tuple[Rollout, float, float]:
        t0 = time.perf_counter()
        got = self._receive(HEAD + self.n * gamma)
        flat = got[HEAD:]
        windows = [flat[i : i + gamma] for i in range(0, len(flat), gamma)]
        return Rollout(windows, got[3], got[4]), t0, time.perf_counter()

    def close(self, grace: float = 2.0) -> None:
        pass

    def kill(self) -> None:
        pass
