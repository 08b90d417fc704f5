"""The draft host: one loop that owns the draft (plain MLX, Speculative-Streaming, Core ML) and answers the
engine over the TokenRing: read a request, roll out every branch, post the windows. The engine never calls
the draft as a function.

By default the host is its own process (`python -m mirror_mlx.drafts.host_process`: a fresh interpreter,
never a fork of a process that holds MLX threads, never a re-run of the user's `__main__`): MLX serializes
two threads of one process that evaluate graphs (docs/design.md §4), and Core ML's `predict` holds the GIL,
so a thread cannot hide the draft. A draft object built in this process (tests, notebooks) runs the same
loop on a thread.

Each direction is a TokenRing (data) plus a pipe (one byte per message: wake-up without spinning, and
end-of-file the moment the other side dies). Contexts travel as deltas against what the host holds.
"""

import atexit
import base64
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, wait
from contextlib import suppress
from functools import partial
from typing import Callable, Optional, Sequence, Union

from mirror_mlx.blas import follow_affinity, preload
from mirror_mlx.engine.model_parts import common_prefix
from mirror_mlx.drafts.api import Draft, Rollout
from mirror_mlx.drafts.recipes import DraftRecipe, mlx_draft, ss_draft
from mirror_mlx.drafts.ring import TokenRing
from mirror_mlx.engine.workers import Worker

# request kinds (engine → host)
CONTEXT, SYNC, ROLLOUT, BRANCHES, RESET, STOP = 1, 2, 3, 4, 5, 6
# reply kinds (host → engine)
READY, DONE, WINDOWS, ERROR = 11, 12, 13, 14

SLOT_INTS = 1 << 17  # ints per message (1 MiB); longer contexts travel in several CONTEXT messages
RING_SLOTS = 4
_own_process = False  # this interpreter is a draft host process (`main`): its BLAS threads are its own to set


class DraftHostError(RuntimeError):
    """The draft host died, or its draft raised."""


WEIGHTS_ONLY = (mlx_draft, ss_draft)  # builders whose host process needs no tokenizer (host_process.py)


# ------------------------------------------------------------------ one direction of the channel


class Channel:
    """A TokenRing plus a notification pipe: `send` writes the message, then one byte; `recv` waits for it."""

    def __init__(self, ring: TokenRing, fd: int):
        self.ring, self.fd, self.seq = ring, fd, 0

    def send(self, kind: int, step: int = 0, ints: Sequence[int] = (), floats: Sequence[float] = ()) -> None:
        self.ring.put(kind, step, ints, floats)
        try:
            os.write(self.fd, b"\1")
        except BrokenPipeError:  # the other end died: said as a read that finds it gone says it
            raise DraftHostError("the draft host exited unexpectedly") from None

    def _take(self):
        if os.read(self.fd, 1) == b"":
            raise DraftHostError("the draft host exited unexpectedly")
        self.seq += 1
        msg = self.ring.get(self.seq)
        if msg is None:
            raise DraftHostError(f"message {self.seq} was announced but is not on the ring")
        return msg

    def recv(self, timeout: Optional[float] = None):
        """Block until the next message (TimeoutError after `timeout` s; DraftHostError if the sender died)."""
        if timeout is not None and not select.select([self.fd], [], [], max(timeout, 0.0))[0]:
            raise TimeoutError(f"the draft host did not answer within {timeout:g} s")
        return self._take()

    async def arecv(self):
        """`recv` for the asyncio loop: waits on the pipe with the loop's selector, no thread, no spinning."""
        if not select.select([self.fd], [], [], 0)[0]:  # not there yet (a hidden rollout usually is)
            import asyncio  # the engine's side only: the host process never needs it

            loop = asyncio.get_running_loop()
            ready = loop.create_future()
            loop.add_reader(self.fd, lambda: ready.done() or ready.set_result(None))
            try:
                await ready
            finally:
                loop.remove_reader(self.fd)
        return self._take()


# ------------------------------------------------------------------ wire format (int64 words)


def encode_stems(gamma: int, stems: Sequence[Sequence[int]]) -> list[int]:
    """[gamma, n_stems, len_0..len_k, stem tokens...]"""
    return [gamma, len(stems)] + [len(s) for s in stems] + [t for s in stems for t in s]


def decode_stems(ints: list[int]) -> tuple[int, list[list[int]]]:
    gamma, n = ints[0], ints[1]
    lens, i, stems = ints[2 : 2 + n], 2 + n, []
    for k in lens:
        stems.append(ints[i : i + k])
        i += k
    return gamma, stems


def branch_stems(gamma: int, window: Sequence[int], cand: list[int], kappa: int) -> list[list[int]]:
    """Every branch of a Mirror-SD step: stem (r, v) = ŷ_1..ŷ_r + [v] for v in C_r, r = 0..γ."""
    return [list(window[:r]) + [cand[r * kappa + i]] for r in range(gamma + 1) for i in range(kappa)]


def _text(ints: Sequence[int]) -> str:
    return bytes(int(i) for i in ints).decode("utf-8", "replace")


# ------------------------------------------------------------------ the host loop


def serve(draft: Draft, req: Channel, rep: Channel) -> None:
    """Answer requests, one reply each, until STOP or the engine's end of the pipe closes. A request carries
    [keep, n_new, new tokens..., body...]: the context is the host's first `keep` tokens plus the new ones."""
    context: list[int] = []
    while True:
        try:
            msg = req.recv()
        except DraftHostError:
            return  # the engine is gone
        if msg.kind == STOP:
            return
        if _own_process:  # the cores its parent placed it on (tune/placement.py): as many BLAS threads
            follow_affinity()
        t0 = time.perf_counter()
        try:
            ints = msg.ints.tolist()
            keep, n = ints[0], ints[1]
            del context[keep:]
            context += ints[2 : 2 + n]
            body = ints[2 + n :]
            if msg.kind == CONTEXT:
                rep.send(DONE, msg.step)
            elif msg.kind == SYNC:
                if hasattr(draft, "sync"):
                    draft.sync(context)
                rep.send(DONE, msg.step)
            elif msg.kind == RESET:
                draft.reset()
                context.clear()
                rep.send(DONE, msg.step)
            elif msg.kind in (ROLLOUT, BRANCHES):
                if msg.kind == ROLLOUT:
                    gamma, stems = decode_stems(body)
                else:  # [gamma, kappa, window (gamma), candidates ((gamma + 1) * kappa)]
                    gamma, kappa = body[0], body[1]
                    stems = branch_stems(gamma, body[2 : 2 + gamma], body[2 + gamma :], kappa)
                out = draft.rollout(context, stems, gamma)
                flat = [t for w in out.windows for t in w]
                rep.send(WINDOWS, msg.step, [out.forwards, out.tokens] + flat, [t0, time.perf_counter()])
            else:
                raise ValueError(f"unknown request kind {msg.kind}")
        except Exception as e:  # noqa: BLE001 - the engine decides what a failing draft means
            text = f"{type(e).__name__}: {e}".encode()[:4000]
            rep.send(ERROR, msg.step, [int(isinstance(e, ValueError))] + list(text))


def _attach(name: str) -> TokenRing:
    return TokenRing(capacity=RING_SLOTS, max_ints=SLOT_INTS, max_floats=2, name=name, create=False, track=False)


def main(argv: Sequence[str]) -> None:
    """The host process's loop (started by host_process.py): REQ_RING REQ_FD REP_RING REP_FD SPEC."""
    for sig in (signal.SIGINT, signal.SIGHUP):  # Ctrl-C and a hang-up are the engine's to handle; it then stops us
        signal.signal(sig, signal.SIG_IGN)
    global _own_process
    _own_process = True
    req_name, req_fd, rep_name, rep_fd, spec = argv
    req, rep = Channel(_attach(req_name), int(req_fd)), Channel(_attach(rep_name), int(rep_fd))

    preload()  # before mlx.core (idempotent), from the module itself: not the package's face

    host(lambda: pickle.loads(base64.b64decode(spec))(), req, rep)


def host(build: Callable[[], Draft], req: Channel, rep: Channel) -> None:
    """Build the draft, say READY (vocabulary size, class) or ERROR, then serve until stopped."""
    with suppress(OSError, DraftHostError):  # the engine closed its ends while we were busy (dropped us): end
        try:
            draft = build()
        except Exception as e:  # noqa: BLE001
            rep.send(ERROR, 0, [0] + list(f"{type(e).__name__}: {e}".encode()[:4000]))
            return
        rep.send(READY, 0, [int(getattr(draft, "vocab_size", 0))] + list(type(draft).__name__.encode()))
        serve(draft, req, rep)


# ------------------------------------------------------------------ the engine's side


_live: "weakref.WeakSet[DraftHost]" = weakref.WeakSet()


def close_all() -> None:
    """Stop every host of this process still open: at interpreter exit (a script that never called
    close), and when a rank of a group ends at once (distributed.faults.die)."""
    for host in list(_live):
        host.close()


atexit.register(close_all)


class DraftHost:
    """The engine's handle on a draft host: posts requests, awaits replies, owns the process and rings.
    `draft`: a DraftRecipe (built inside the host) or a draft object built here (run on a thread)."""

    def __init__(self, draft: Union[Draft, "DraftRecipe"], process: Optional[bool] = None,
                 start_timeout: float = 120.0):
        self._closing = threading.Lock()  # one close at a time (the engine's loop thread, a signal's exit)
        self.process = isinstance(draft, DraftRecipe) if process is None else process
        if self.process and not isinstance(draft, DraftRecipe):
            raise TypeError("a draft object cannot move to another process: pass a DraftRecipe, or process=False")
        if isinstance(draft, DraftRecipe) and self.process and getattr(draft.build, "__module__", "") == "__main__":
            raise TypeError(f"the draft host cannot import {draft.build.__name__} from your __main__ script: "
                            "define the DraftRecipe's builder in an importable module")
        self.draft = draft
        self.proc: Optional[subprocess.Popen] = None
        self.thread: Optional[threading.Thread] = None  # an in-process host's thread (a Worker's)
        self._worker: Optional[Worker] = None
        self._served: Optional[Future] = None  # the in-process host's loop: done once it has ended
        self.held: list[int] = []  # the context the host holds (what deltas are taken against)
        self.step = 0
        self.owed: deque[tuple[int, int]] = deque()  # (step, reply kind) of each request not answered yet, in order
        rings = [TokenRing(capacity=RING_SLOTS, max_ints=SLOT_INTS, max_floats=2) for _ in range(2)]
        (req_r, req_w), (rep_r, rep_w) = os.pipe(), os.pipe()
        self.req, self.rep = Channel(rings[0], req_w), Channel(rings[1], rep_r)
        self._theirs = [req_r, rep_w]  # the host's ends
        _live.add(self)
        try:
            if self.process and isinstance(draft, DraftRecipe):  # (checked above: a process builds a recipe)
                self._start_process(draft)
            else:
                self._start_thread(draft)
            msg = self.rep.recv(start_timeout)
            if msg.kind == ERROR:
                raise DraftHostError(f"the draft host could not build its draft {draft}: {_text(msg.ints[1:])}")
            self.vocab_size = int(msg.ints[0])
            self.kind = _text(msg.ints[1:])  # the draft's class, as built in the host
        except BaseException:
            self.close()
            raise

    def _start_process(self, spec: DraftRecipe) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        blob = base64.b64encode(pickle.dumps(partial(spec.build, *spec.args))).decode()
        req_r, rep_w = self._theirs
        lean = ["--weights-only"] if spec.build in WEIGHTS_ONLY else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mirror_mlx.drafts.host_process", *lean, self.req.ring.name, str(req_r),
             self.rep.ring.name, str(rep_w), blob], pass_fds=(req_r, rep_w), env=env, stdin=subprocess.DEVNULL)
        for fd in self._theirs:  # only the host holds them now: its death reads as end-of-file here
            os.close(fd)
        self._theirs = []

    def _start_thread(self, draft: Union[Draft, DraftRecipe]) -> None:
        req_r, rep_w = self._theirs
        self._theirs = []

        def run() -> None:
            build = partial(draft.build, *draft.args) if isinstance(draft, DraftRecipe) else lambda: draft
            try:
                host(build, Channel(self.req.ring, req_r), Channel(self.rep.ring, rep_w))
            finally:
                os.close(req_r)
                os.close(rep_w)

        # a Worker's thread, not a thread of its own: MLX threads must not end at interpreter exit (workers.py)
        self._worker = Worker("draft-host")
        self.thread = self._worker.thread
        self._served = self._worker.submit(run)

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    # ---- requests

    def _post(self, kind: int, context: Sequence[int], body: Sequence[int] = ()) -> None:
        """Post one request whose context is `context` (sent as a delta; a long one in CONTEXT chunks first)."""
        held = self.held
        keep = len(held) if context[: len(held)] == held else common_prefix(held, context)
        new = list(context[keep:])
        room = SLOT_INTS - 2 - len(body)
        if room < 0:
            raise ValueError(f"a draft request of {len(body)} tokens exceeds the host's {SLOT_INTS}-token "
                             "message: lower kappa or gamma")
        while len(new) > room:  # the head of a long context first, acknowledged chunk by chunk
            chunk, new = new[: SLOT_INTS - 2], new[SLOT_INTS - 2 :]
            self._send(CONTEXT, [keep, len(chunk)] + chunk)
            self._last(None)
            keep += len(chunk)
        self._send(kind, [keep, len(new)] + new + list(body))
        self.held = list(context)

    def _send(self, kind: int, ints: list[int]) -> None:
        self.step += 1
        self.req.send(kind, self.step, ints)
        self.owed.append((self.step, WINDOWS if kind in (ROLLOUT, BRANCHES) else DONE))

    def _expect(self, msg):
        """`msg` as the answer to the oldest request not answered yet (an error is raised as what it says)."""
        step, kind = self.owed.popleft() if self.owed else (None, None)
        if msg.kind == ERROR:
            self.held = []  # the host may hold anything now
            raise (ValueError if msg.ints[0] else DraftHostError)(_text(msg.ints[1:]))
        if msg.kind != kind or msg.step != step:
            raise DraftHostError(f"the draft host answered {msg.kind} for step {msg.step}; expected {kind}")
        return msg

    def _last(self, timeout: Optional[float]):
        """Read every answer owed (a prepare's among them) and return the last one's message."""
        while True:
            msg = self._expect(self.rep.recv(timeout))
            if not self.owed:
                return msg

    def post_sync(self, context: Sequence[int]) -> None:
        """Prefill the draft's cache with `context` (answer with `wait_done`)."""
        self._post(SYNC, context)

    # mirror posts the committed tokens and the window when the target starts its prefix, so the draft feeds
    # the window then and the branch rollout only each branch's own token; the next answer read takes its
    # acknowledgement first
    post_prepare = post_sync

    def wait_done(self, timeout: Optional[float]) -> None:
        if self._last(timeout).kind != DONE:
            raise DraftHostError("the draft host answered windows where an acknowledgement was expected")

    def reset(self, timeout: Optional[float] = None) -> None:
        self._send(RESET, [0, 0])
        self.held = []
        self.wait_done(timeout)

    def post_rollout(self, context: Sequence[int], stems: Sequence[Sequence[int]], gamma: int) -> None:
        """One batched rollout of `stems` after `context` (answer with `windows`)."""
        self._post(ROLLOUT, context, encode_stems(gamma, stems))

    def post_branches(self, context: Sequence[int], window: Sequence[int], cand: list[list[int]]) -> None:
        """Mirror-SD's branch rollout: stems ŷ_1..ŷ_r + [v] for every v in the early-exit set C_r."""
        kappa = len(cand[0])
        self._post(BRANCHES, context, [len(window), kappa] + list(window) + [v for row in cand for v in row])

    async def windows(self, gamma: int) -> tuple[Rollout, float, float]:
        """Await the reply to the last rollout: (Rollout, start, end) on the host's perf_counter clock."""
        while True:
            msg = self._expect(await self.rep.arecv())
            if not self.owed:
                return self._windows(msg, gamma)

    def rollout(self, context: Sequence[int], stems: Sequence[Sequence[int]], gamma: int,
                timeout: Optional[float] = None) -> Rollout:
        """Post a rollout and wait for it (scripts and tests; the engine posts and awaits instead)."""
        self.post_rollout(context, stems, gamma)
        return self._windows(self._last(timeout), gamma)[0]

    def _windows(self, msg, gamma: int) -> tuple[Rollout, float, float]:
        if msg.kind != WINDOWS:
            raise DraftHostError("the draft host answered an acknowledgement where windows were expected")
        ints = msg.ints.tolist()
        flat = ints[2:]
        windows = [flat[i : i + gamma] for i in range(0, len(flat), gamma)]
        return Rollout(windows=windows, forwards=ints[0], tokens=ints[1]), float(msg.floats[0]), float(msg.floats[1])

    # ---- the end

    def close(self, grace: float = 2.0) -> None:
        """Stop the host: STOP, then SIGTERM/SIGKILL after `grace` s; unlink the rings. Idempotent: a second
        caller waits for the first, then finds it closed."""
        with self._closing:
            if getattr(self, "req", None) is not None:
                self._close(grace)

    def _close(self, grace: float) -> None:
        with suppress(Exception):  # a full ring or a closed pipe: the host is going anyway
            if self.proc is not None and self.proc.poll() is None or self.thread is not None:
                self.req.send(STOP, 0, [0, 0])
        if self.proc is not None:
            _end_process(self.proc, grace)
        stalled = False
        if self._worker is not None:
            # a stalled draft thread cannot be killed: it is left to finish (then it parks, see workers.py)
            assert self._served is not None, "a host thread's loop is served"
            stalled = not wait([self._served], grace).done
            self._worker.close(join_timeout=0.0 if stalled else 5.0)
        for fd in [self.req.fd, self.rep.fd] + self._theirs:
            with suppress(OSError):
                os.close(fd)
        for ring in (self.req.ring, self.rep.ring):
            if stalled:  # the stalled thread still maps it: unlink the name, keep the mapping
                ring.shm.unlink()
            else:
                ring.close()
        self.req = self.rep = None  # type: ignore[assignment]  # (None: closed, what `close` reads; never used after)
        _live.discard(self)

    def kill(self) -> None:
        """Drop a host that failed: no grace for a stalled or dead one."""
        self.close(grace=0.0)


def _end_process(proc: subprocess.Popen, grace: float) -> None:
    for step in (None, proc.terminate, proc.kill):
        if step is not None:
            step()
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace if step is None else 2.0)
            return

