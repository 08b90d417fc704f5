"""Across Macs: the target sharded over MLX distributed (`mlx.launch`), the draft beside rank 0.

Every rank runs the same engine over its shard of the target (mlx-lm's `sharded_load`: tensor parallel
through `model.shard(group)` where the family has it, else, or with `pipeline=True`, mlx-lm's split by
layers, where the exit's stage shares its top-κ: `StageTargetSide`, docs/design.md §8), so every rank runs
the same forwards and, from the same reduced logits, decides the same tokens (the ring backend's
`all_sum` gives every rank the same bits; a rank that disagrees is stopped, see `MirrorHost`). Only rank 0
runs a draft host. Its answers reach the other ranks through one small collective per request: an
`all_sum` of an int32 array that only rank 0 fills (`SharedHost` sends, `MirrorHost` receives: the same
interface as ane_draft/host.py's DraftHost, so the engine does not know it is distributed).

A server (`mirror-mlx serve` under the launcher): rank 0 serves HTTP with its pipeline `leading`, the other
ranks `follow` it. Each request rank 0 starts (its ids, options and what its target cache holds) and each
step, or an early stop, is told through the same kind of all_sum before it runs, so every rank runs the
same generations step by step, one request at a time.

Faults: a rank that dies makes MLX's ring raise on the others ("connection to a peer was lost"), and
`mlx.launch` stops every rank once one exits with an error; a rank that stalls is ended by the watchdog
(`MIRROR_MLX_DIST_TIMEOUT` seconds without a step, 120 by default). Either way each rank ends its draft
host, unlinks its shared memory and exits with one line on stderr.
"""

import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import mlx.core as mx

from .ane_draft.host import DraftHost, DraftHostError, _close_all
from .draft_api import Rollout
from .pipeline import Pipeline, check_adapter_path, load_draft
from .target import StageTargetSide, text_model
from .tune.policy import SAFE_KNOBS, knobs_from, needs_knobs

OK, FAILED = 1, 2  # a reply's first word
HEAD = 5  # [status, len(context), context[-1], forwards, tokens] before the windows
TIMEOUT_ENV = "MIRROR_MLX_DIST_TIMEOUT"
LAUNCHER_ENV = ("MLX_RANK", "OMPI_COMM_WORLD_RANK")  # set by mlx.launch (ring, jaccl) and by mpirun

_group: Optional[mx.distributed.Group] = None
_dying = threading.Lock()


def launched() -> bool:
    """Whether this process was started by a launcher (mlx.launch or mpirun)."""
    return any(name in os.environ for name in LAUNCHER_ENV)


def group() -> Optional[mx.distributed.Group]:
    """The launcher's group when it has more than one rank, else None (a single process: nothing changes)."""
    global _group
    if not launched():
        return None
    if _group is None:
        _group = mx.distributed.init()
    return _group if _group.size() > 1 else None


def share(values: Sequence[int], size: int, g: mx.distributed.Group) -> list[int]:
    """Rank 0's `values` (padded to `size`) on every rank: an all_sum that only rank 0 fills."""
    buf = [0] * size
    if g.rank() == 0:
        buf[: len(values)] = values
    out = mx.distributed.all_sum(mx.array(buf, dtype=mx.int32), group=g, stream=mx.cpu)
    return out.tolist()


def comm_per_forward(model: Any, g: mx.distributed.Group, rows: Sequence[int] = (1, 4, 8, 16, 32),
                     reps: int = 20) -> dict[int, float]:
    """T_comm by row count: seconds of the all_sums one tensor-parallel forward of `rows` rows makes (2 per layer,
    each rows × hidden), measured alone. Every rank must call it (a collective)."""
    from .target import text_model

    inner = text_model(model)
    hidden, layers = inner.args.hidden_size, len(inner.layers)
    out = {}
    for r in rows:
        x = mx.zeros((r, hidden))
        mx.eval(mx.distributed.all_sum(x, group=g, stream=mx.cpu))
        t0 = time.perf_counter()
        for _ in range(reps):
            mx.eval(mx.distributed.all_sum(x, group=g, stream=mx.cpu))
        out[r] = 2 * layers * (time.perf_counter() - t0) / reps
    return out


def _tail(context: Sequence[int]) -> list[int]:
    return [len(context), context[-1] if len(context) else -1]


class SharedHost:
    """Rank 0: the real draft host; each answer the engine waits for is also shared with the other ranks.

    A request that fails to post is held and raised at its answer, so every rank sees the failure at the
    same collective (and drops the draft together, as one process would)."""

    def __init__(self, host: DraftHost, g: mx.distributed.Group, watchdog: "Watchdog"):
        self.host, self.group, self.watchdog = host, g, watchdog
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
        self._post(self.host.post_sync, context)

    def post_rollout(self, context: Sequence[int], stems: Sequence[Sequence[int]], gamma: int) -> None:
        self.n = len(stems)
        self._post(self.host.post_rollout, context, stems, gamma)

    def post_branches(self, context: Sequence[int], window: Sequence[int], cand: list[list[int]]) -> None:
        self.n = len(cand) * len(cand[0])
        self._post(self.host.post_branches, context, window, cand)

    def _status(self, size: int, values: Sequence[int]) -> None:
        with self.watchdog.waiting("rank 0's draft answer"):
            share(values, size, self.group)

    def _answer(self, wait, size: int):
        try:
            if self.failed is not None:
                failed, self.failed = self.failed, None
                raise failed
            out = wait()
        except BaseException:
            self._status(size, [FAILED])
            raise
        return out

    def wait_done(self, timeout: Optional[float]) -> None:
        self._answer(lambda: self.host.wait_done(timeout), HEAD)
        self._status(HEAD, [OK] + self.tail)

    def reset(self, timeout: Optional[float] = None) -> None:
        self.tail = [0, -1]
        self._answer(lambda: self.host.reset(timeout), HEAD)
        self._status(HEAD, [OK] + self.tail)

    async def windows(self, gamma: int) -> tuple[Rollout, float, float]:
        size = HEAD + self.n * gamma
        try:
            if self.failed is not None:
                failed, self.failed = self.failed, None
                raise failed
            out, r0, r1 = await self.host.windows(gamma)
            flat = [t for w in out.windows for t in w]
            if len(flat) != self.n * gamma:
                raise DraftHostError(f"the draft answered {len(flat)} tokens for {self.n} windows of {gamma}")
        except BaseException:  # (a timeout's cancellation too: the other ranks must hear of it)
            self._status(size, [FAILED])
            raise
        self._status(size, [OK] + self.tail + [out.forwards, out.tokens] + flat)
        return out, r0, r1

    def close(self, grace: float = 2.0) -> None:
        self.host.close(grace)

    def kill(self) -> None:
        self.host.kill()


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


class Diverged(RuntimeError):
    """Two ranks hold different committed tokens (never expected: the ranks reduce to the same bits)."""


# ------------------------------------------------------------------ faults


def die(message: str, code: int = 1) -> None:
    """One line on stderr, every draft host of this process ended and its shared memory unlinked, exit.
    (os._exit: a thread blocked in a collective would keep a normal exit waiting forever.)"""
    if not _dying.acquire(blocking=False):  # already ending (say, SIGTERM while a lost peer is said): one line
        return
    rank = _group.rank() if _group is not None else 0
    try:
        os.write(2, f"mirror-mlx: rank {rank}: {message}\n".encode())
        _close_all()
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

    def waiting(self, what: str) -> "_Waiting":
        return _Waiting(self, what)

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


class _Waiting:
    """A wait the watchdog times; nested ones restore the outer wait, its clock started over."""

    def __init__(self, dog: Watchdog, what: str):
        self.dog, self.what, self.outer = dog, what, None

    def __enter__(self) -> None:
        with self.dog.lock:
            self.outer = self.dog.what
            self.dog.what, self.dog.since = self.what, time.monotonic()

    def __exit__(self, *exc: Any) -> None:
        with self.dog.lock:
            self.dog.what, self.dog.since = self.outer, time.monotonic()


def _on_signal(signum: int, frame: Any) -> None:
    die(f"stopped by {signal.Signals(signum).name} (mlx.launch stops every rank once one has failed)", 128 + signum)


def lost_peer(e: BaseException) -> bool:
    """MLX's error when a collective's peer is gone (its ring backend says "[ring] ...")."""
    return isinstance(e, RuntimeError) and "[ring]" in str(e) or isinstance(e, Diverged)


# ------------------------------------------------------------------ the pipeline

NO_PROMPT_CACHE = ("a prompt cache file cannot be continued across ranks: each rank's cache holds its shard of the "
                   "keys and values; run without it")


class DistributedPipeline(Pipeline):
    """A Pipeline whose calls run on every rank of the group, in step.

    Mode auto does not calibrate here: with no knob given it runs the choice of the pair's profile for this
    rank count (`mirror-mlx tune` under the launcher wrote it; rank 0 reads it and shares the choice), else
    mirror (ar without a draft) with the knobs given. A knob left out, in an explicit mode too, comes from that
    profile's best row for the mode (`profile_knobs`); without a profile, the small safe ones (κ=1, γ=3,
    ℓ_e = the adapter's layer or N/2; never the paper's κ=8, γ=7 blindly), said in `stats.why`. An unseeded
    sample gets a seed rank 0 draws (every rank must draw the same tokens)."""

    group: mx.distributed.Group
    watchdog: Watchdog
    split = "tensor"  # or "pipeline": mlx-lm's split by layers (--pipeline, or a family without model.shard)
    leading = False  # rank 0 of a server: its streams and resets are told to the other ranks (`follow`)

    def agree(self, values: Sequence[int], size: int, what: str) -> list[int]:
        """Rank 0's `values` (padded to `size`) on every rank, the watchdog naming `what` is awaited.
        A collective: every rank calls it."""
        with self.watchdog.waiting(what):
            return share(values, size, self.group)

    def prepare(self, prompt: Any, prompt_cache: Any = None, **kwargs: Any):
        if prompt_cache is not None:  # (its keys and values are the whole model's; each rank holds a shard's)
            raise ValueError(NO_PROMPT_CACHE)
        mode = kwargs.get("mode", "auto")
        why = []
        given = any(kwargs.get(k) is not None for k in ("kappa", "gamma", "exit_layer"))
        tuned = mode == "auto" and self.draft is not None and self.split == "tensor" and not given and self.tuned()
        if tuned:  # (no knob given: the profile's choice as it is)
            mode, kwargs["kappa"], kwargs["gamma"], kwargs["exit_layer"], said = tuned
            kwargs["mode"] = mode
            kwargs["kappa"] = kwargs["kappa"] or SAFE_KNOBS["kappa"]  # (sd and ar leave κ unused)
            kwargs["gamma"] = kwargs["gamma"] or SAFE_KNOBS["gamma"]  # (ar leaves γ unused)
            why.append(f"auto: the tuned profile of {self.group.size()} ranks" + (f", {said}" if said else ""))
        elif mode == "auto":
            mode = kwargs["mode"] = "ar" if self.draft is None else "mirror"
            reason = ("no draft model" if self.draft is None else
                      "split by layers across ranks: tune measures the tensor-parallel split only" if self.split == "pipeline" else
                      "knobs given: across ranks the tuning profile serves auto without them" if given else
                      "no tuning profile for these ranks: `mirror-mlx tune` under the launcher makes one")
            why.append(f"auto: {mode} ({reason})")
        if mode in ("mirror", "sd") and not tuned and self.draft is not None and self.split == "tensor" \
                and needs_knobs(mode, kwargs.get("kappa"), kwargs.get("gamma")):
            knobs = self.profile_knobs(mode, kwargs.get("kappa"), kwargs.get("gamma"), kwargs.get("exit_layer"))
            if knobs:
                kwargs["kappa"], kwargs["gamma"], kwargs["exit_layer"], said = knobs
                why.append(said)
        if mode in ("mirror", "sd"):
            for knob, value in SAFE_KNOBS.items():
                if kwargs.get(knob) is None:
                    kwargs[knob] = value
                    why.append(f"{knob} {value} (small safe default, uncalibrated)")
        if kwargs.get("seed") is None and (kwargs.get("temperature") or kwargs.get("sampler") is not None):
            kwargs["seed"] = self.agree([random.getrandbits(31)], 1, "rank 0's seed")[0]
        given = kwargs.get("prompt_progress_callback")

        def progress(done: int, total: int) -> None:  # a long prefill is progress, not a stall
            self.watchdog.beat()
            if given is not None:
                given(done, total)

        kwargs["prompt_progress_callback"] = progress
        ids, opts, run = super().prepare(prompt, prompt_cache, **kwargs)
        if why:
            opts = replace(opts, why="; ".join(why))
        return ids, opts, run

    _tuned: Optional[tuple] = None  # the profile's (mode, κ, γ, ℓ_e, why) once asked; () when there is none
    _knobs: Optional[dict] = None  # profile_knobs' answers, by the knobs asked (the same on every rank)
    _read: Optional[list] = None  # rank 0: [the profile for this rank count, or None], read once

    def _profile(self) -> Any:
        """Rank 0: this pair's profile for this rank count, or None; read once, a broken one said once."""
        if self._read is None:
            from .tune import profile as profiles

            try:
                self._read = [profiles.load(profiles.pipe_key(self), self.engine)]
            except profiles.ProfileError as e:
                print(f"mirror-mlx: {e}; the uncalibrated knobs run", file=sys.stderr)
                self._read = [None]
        return self._read[0]

    def tuned(self) -> tuple:
        """The profile's choice for this pair and rank count, as rank 0 read it (asked once, on every rank
        alike), or () without a profile."""
        if self._tuned is None:
            from .tune.choose import describe

            modes = ("ar", "sd", "mirror")
            prof = self._profile() if self.group.rank() == 0 else None
            why = f"{describe(prof)}: {prof.why}" if prof is not None else ""
            head = [1 + modes.index(prof.mode), prof.kappa or 0, prof.gamma or 0, prof.exit_layer or 0] if prof else []
            got = self.agree(head, 4, "rank 0's tuning profile")
            self._tuned = (modes[got[0] - 1], *(v or None for v in got[1:]), why) if got[0] else ()
        return self._tuned

    def profile_knobs(self, mode: str, kappa: Optional[int], gamma: Optional[int],
                      exit_layer: Optional[int]) -> tuple:
        """An explicit mode's missing knobs from this rank count's tuning profile, as one process takes them
        from its own (`policy.knobs_from`), chosen by rank 0 and shared (once per knobs asked): (κ, γ, ℓ_e,
        why), or () without a profile (then the small safe ones)."""
        self._knobs = self._knobs if self._knobs is not None else {}
        asked = (mode, kappa, gamma, exit_layer)
        if asked not in self._knobs:
            prof = self._profile() if self.group.rank() == 0 else None
            head, why = [], ""
            if prof is not None:
                c = knobs_from(prof, self, mode, kappa, gamma, exit_layer)
                head, why = [1, c.kappa or 0, c.gamma or 0, c.exit_layer or 0], f"{c.why} of {self.group.size()} ranks"
            got = self.agree(head, 4, "rank 0's tuning profile")
            self._knobs[asked] = (*(v or None for v in got[1:]), why) if got[0] else ()
        return self._knobs[asked]

    def _chunks(self, *args: Any, **kwargs: Any) -> Iterator:
        """The steps, each timed by the watchdog; a lost peer ends this rank with one line."""
        steps = super()._chunks(*args, **kwargs)
        try:
            while True:
                with self.watchdog.waiting("a step of the other ranks"):
                    try:
                        chunk = next(steps)
                    except StopIteration:
                        return
                yield chunk
        except BaseException as e:
            if lost_peer(e):
                die(f"lost a rank of the group ({e}): stopping")
            raise
        finally:
            steps.close()

    # --- a server across ranks: rank 0 leads (these overrides), the other ranks `follow`

    def stream(self, prompt: Any, prompt_cache: Any = None, **kwargs: Any) -> Iterator:
        """Leading: the request (its ids and options) goes to the other ranks first, then each step is told
        before it runs, so every rank runs the same generation step by step."""
        if not self.leading:
            return super().stream(prompt, prompt_cache, **kwargs)
        if prompt_cache is not None:
            raise ValueError(NO_PROMPT_CACHE)
        if isinstance(prompt, str):
            from .validate import clean_text

            prompt = self.encode(clean_text(prompt)[0])
        ids = [int(t) for t in prompt]
        try:
            options = json.dumps(kwargs).encode()
        except TypeError as e:
            raise ValueError(f"these options cannot be sent to the other ranks ({e}): give plain values") from None
        self._tell(START, len(ids), len(options), *held(self))
        with self.watchdog.waiting("the other ranks to take the request"):
            self._collective(lambda: share(ids + list(options), len(ids) + len(options), self.group))
        return self._lead(super().stream(ids, **kwargs))

    def _lead(self, chunks: Iterator) -> Iterator:
        ended = False  # the other ranks saw the end too (their stream ended at the same chunk)
        try:
            while True:
                self._tell(STEP)
                try:
                    chunk = next(chunks)
                except StopIteration:
                    ended = True
                    return
                ended = chunk.finish_reason is not None
                yield chunk
                if ended:
                    return
        finally:
            if not ended:  # closed early (a client went away, a stop string, shutdown) or failed
                self._tell(STOP)
            chunks.close()

    def reset(self) -> None:
        if self.leading:
            self._tell(RESET)
        super().reset()

    def close(self) -> None:
        if self.leading and not self._closed:
            self.leading = False
            self._tell(QUIT)
        super().close()

    def _tell(self, kind: int, *args: int) -> None:
        with self.watchdog.waiting("the other ranks to follow"):
            self._collective(lambda: share([kind, *args], MESSAGE, self.group))

    @staticmethod
    def _collective(fn: Any) -> Any:
        try:
            return fn()
        except BaseException as e:
            if lost_peer(e):
                die(f"lost a rank of the group ({e}): stopping")
            raise


START, STEP, STOP, RESET, QUIT = 1, 2, 3, 4, 5  # what rank 0 of a server tells the others: [kind, ...]
MESSAGE = 5  # [START, prompt ids, option bytes, tokens the target's cache holds, their checksum]; else [kind]


def held(pipe: Pipeline) -> list[int]:
    """What the target's cache holds before a request: its token count and a checksum. Every rank must hold
    the same (the same requests ran, the prefix cache restored the same entry)."""
    target = pipe.engine.target
    cached = pipe.engine.target_worker.call(lambda: list(target.cached))
    return [len(cached), sum((i + 1) * t for i, t in enumerate(cached)) % (1 << 31)]


GRACE_S = 10.0  # a rank of a server told to stop ends within this long (stop_within_grace)


def follow(pipe: DistributedPipeline, prefixes: Any = None) -> None:
    """Ranks > 0 of a server: run what rank 0 (`DistributedPipeline.leading`) runs, step by step, until it
    ends. Waiting for the next request is no stall (no watchdog); within a request rank 0 is timed.
    `prefixes`: this rank's PrefixCache, restored and stored where rank 0's scheduler does (before a request;
    after one that ended by itself), so it holds what rank 0's holds, for this rank's shard."""
    g = pipe.group
    stream: Optional[Iterator] = None
    stepped = False  # a step of `stream` ran
    failed: Optional[BaseException] = None

    def receive(size: int, what: Optional[str]) -> list[int]:
        if what is None:
            return pipe._collective(lambda: share([], size, g))
        with pipe.watchdog.waiting(what):
            return pipe._collective(lambda: share([], size, g))

    def end() -> None:
        nonlocal stream, stepped
        stepped = False
        if stream is not None:
            stream, s = None, stream
            s.close()

    while True:
        kind, a, b, *cache = receive(MESSAGE, None if stream is None else "rank 0's next step")
        if kind == QUIT:
            end()
            return
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


_grace: list = []


def stop_within_grace(signum: int, frame: Any = None) -> None:
    """A server's rank asked to stop (SIGINT/SIGTERM/SIGHUP, or its launcher gone) ends within GRACE_S s:
    rank 0 stops as one process does (the step in course ends, the other ranks are told QUIT); a step that
    cannot end (a rank lost or stalled: the ring may wait for it forever) or a rank 0 that never says QUIT
    ends this rank with one line instead."""
    if _grace:
        return
    name = signal.Signals(signum).name
    waited = "the step in course did not end" if _group is not None and _group.rank() == 0 else \
        "rank 0 did not end the run"
    timer = threading.Timer(GRACE_S, die, (f"stopped by {name}; {waited} in {GRACE_S:g} s (a rank lost or "
                                           "stalled?)", 128 + signum))
    timer.daemon = True
    timer.start()
    _grace.append(timer)


def serve_follower(pipe: DistributedPipeline, prefixes: Any = None) -> None:
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


def end_with_launcher(interval: float = 0.5) -> None:
    """A rank whose launcher is gone (killed: mlx.launch passes no SIGTERM on) stops as on SIGTERM. Its
    output, which no one reads now, goes to /dev/null (a write would fail)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        rank = _group.rank() if _group is not None else 0
        try:
            os.write(2, f"mirror-mlx: rank {rank}: the launcher is gone: stopping\n".encode())
        except OSError:
            pass
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="mirror-launcher-watch", daemon=True).start()


def load(model: Union[str, Path], draft_model: Optional[Union[str, Path]] = None,
         exit_adapter: Optional[Union[str, Path]] = None, *, adapter_path: Optional[Union[str, Path]] = None,
         tokenizer_config: Optional[dict] = None, trust_remote_code: bool = False, pipeline: bool = False,
         g: Optional[mx.distributed.Group] = None) -> DistributedPipeline:
    """`mirror_mlx.load` on every rank of the launcher's group: this rank's shard of the target (mlx-lm's
    `sharded_load`), the draft host on rank 0 only. Every rank must then make the same calls.

    The split is sharded_load's: tensor parallel where the family has `model.shard`, else its pipeline split
    (layers by rank); `pipeline=True` asks for the pipeline split (mlx-lm's `--pipeline`)."""
    from mlx_lm.utils import sharded_load

    from .loading import check_vocabulary, resolve_model

    g = g or group()
    if g is None:
        raise ValueError("no distributed group: start every rank with mlx.launch (e.g. `mlx.launch -n 2 "
                         "--backend ring -- python -m mirror_mlx generate ...`)")
    if adapter_path is not None:
        check_adapter_path(adapter_path)
        raise ValueError("adapter_path is not supported across ranks (as mlx-lm's sharded loading): fuse the "
                         "adapter into the model first (mlx_lm.fuse)")
    if str(exit_adapter).lower() == "none":
        exit_adapter = None
    folder = resolve_model(model)
    config = dict(tokenizer_config or {}, trust_remote_code=trust_remote_code)
    try:
        target, tokenizer = sharded_load(str(folder), g if pipeline else None, tokenizer_config=config,
                                         trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise ValueError(f"cannot shard {model} over {g.size()} ranks: {e}") from None
    check_vocabulary(target, tokenizer, folder)
    draft = load_draft(draft_model, tokenizer) if draft_model is not None else None
    adapter = None
    if exit_adapter is not None:
        from mlx_lm.utils import load_model

        from .exit_adapter import load_adapters

        # checked against the whole model's fingerprint (a shard's shapes differ); lazy: only what it reads
        adapter = load_adapters(exit_adapter, load_model(folder, lazy=True, strict=False)[0])
    watchdog = Watchdog(float(os.environ.get(TIMEOUT_ENV, "120")))
    if threading.current_thread() is threading.main_thread():  # (only the main thread may set handlers)
        for sig in (signal.SIGTERM, signal.SIGHUP):  # mlx.launch stops the others with SIGTERM when one fails
            signal.signal(sig, _on_signal)
    rank = g.rank()
    pipe = DistributedPipeline(target, tokenizer, draft if rank == 0 else None, adapter, name=str(model))
    pipe.group, pipe.watchdog = g, watchdog
    engine = pipe.engine
    if getattr(text_model(target).model, "pipeline_size", 1) > 1:  # layers by rank: block ℓ_e on one stage
        pipe.split = "pipeline"
        engine.n_layers = share([len(text_model(target).model.layers)], 1, g)[0]  # (rank 0 holds the last block)
        engine.target_worker.call(engine.target.close)
        engine.target = engine.target_worker.call(StageTargetSide, target, g, engine.n_layers)
    engine.local_build = None  # sd drafts through the host too: rank 0's window must reach every rank
    if draft is not None:
        if rank == 0:
            engine.host = SharedHost(engine.host, g, watchdog)
        else:
            from .engine import draft_context

            pipe.draft = engine.draft = draft
            engine.draft_context = draft_context(draft)
            engine.host = MirrorHost(g, engine.vocab_size, watchdog)
    share([1], 1, g)  # every rank loaded (rank 0 started its draft host): the watchdog times steps from here
    return pipe


def quiet_other_ranks() -> None:
    """The command line on ranks > 0: nothing on stdout or stderr but `die`'s line (rank 0 prints and serves)."""
    g = group()
    if g is None or g.rank() == 0:
        return
    if os.environ.get("MIRROR_MLX_DIST_VERBOSE") == "1":  # (debugging: every rank prints)
        return
    devnull = open(os.devnull, "w")
    sys.stdout = sys.stderr = devnull

    def hook(kind, value, tb) -> None:
        os.write(2, f"mirror-mlx: rank {g.rank()}: {kind.__name__}: {value}\n".encode())

    sys.excepthook = hook
