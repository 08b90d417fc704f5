"""`DistributedPipeline`: a Pipeline whose calls run on every rank of the group, in step, and `load`, which
builds it on every rank (mlx-lm's `sharded_load`, the draft host beside rank 0)."""

import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Generator, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.utils import load_model, sharded_load

from .. import validate
from ..chunks import Chunk, Detokenizer
from ..engine import draft_context
from ..engine.exit_adapter import load_adapters
from ..proposers.lookup import LOOKUP
from ..options import given
from ..pipeline import Pipeline, check_adapter_path, load_draft
from ..engine.model_parts import text_model
from ..engine.target import StageTargetSide
from ..loading import check_vocabulary, resolve_model
from ..tune import profile as profiles
from ..tune.cost_model import describe
from ..tune.policy import SAFE_KNOBS
from ..tune.profile import Profile
from .faults import TIMEOUT_ENV, Watchdog, collective, on_interrupt, on_stop_signal
from .group import group, share
from .shared_draft import MirrorHost, SharedHost

if TYPE_CHECKING:
    from ..options import Plan

NO_LOOKUP = ("the prompt lookup runs in one process, not across the ranks of mlx.launch: start it without the "
             "launcher, or drop lookup")
NO_PROMPT_CACHE = ("a prompt cache file cannot be continued across ranks: each rank's cache holds its shard of the "
                   "keys and values; run without it")


class DistributedPipeline(Pipeline):
    """A Pipeline whose calls run on every rank of the group, in step: modes resolve as in one process, from the
    pair's profile for this rank count that rank 0 reads and shares (`profile`); without one auto runs mirror
    (ar without a draft) and a knob left out is a small safe one (κ=1, γ=3, ℓ_e = the adapter's layer or N/2;
    never the paper's κ=8, γ=7 blindly), said in `stats.why`."""

    group: mx.distributed.Group
    watchdog: Watchdog
    split = "tensor"  # or "pipeline": mlx-lm's split by layers (--pipeline, or a family without model.shard)
    leading = False  # rank 0 of a server: its streams and resets are told to the other ranks (`follow`)
    _busy = False  # (leading) a request runs: the ring is its forwards', no idle tick

    def agree(self, values: Sequence[int], size: int, what: str) -> list[int]:
        """Rank 0's `values` (padded to `size`) on every rank, the watchdog naming `what` is awaited.
        A collective: every rank calls it."""
        with self.watchdog.waiting(what):
            return share(values, size, self.group)

    def resolve(self, plan: "Plan") -> "Plan":
        """`Pipeline.resolve`, then what running across ranks adds: rank 0's seed for an unseeded sample, the
        watchdog beaten by the prefill's progress, and auto's choice kept (auto's runs neither adapt it nor
        leave the draft here: each rank would judge alone)."""
        if plan.resolved:
            return plan
        if plan.prompt_cache is not None:  # (its keys and values are the whole model's; each rank holds a shard's)
            raise ValueError(NO_PROMPT_CACHE)
        if plan.asked.lookup:
            raise ValueError(NO_LOOKUP)
        plan = super().resolve(plan)
        opts = plan.opts
        if plan.run is not None:
            opts = replace(opts, why=f"{opts.why}; {KEPT}")
        if opts.seed is None and (opts.temperature or opts.sampler is not None):
            opts = replace(opts, seed=self.agree([random.getrandbits(31)], 1, "rank 0's seed")[0])
        return replace(plan, opts=replace(opts, prompt_progress_callback=self._beating(opts.prompt_progress_callback)),
                       run=None)

    def _beating(self, given: Optional[Callable[[int, int], None]]) -> Callable[[int, int], None]:
        def progress(done: int, total: int) -> None:  # a long prefill is progress, not a stall
            self.watchdog.beat()
            if given is not None:
                given(done, total)

        return progress

    def profile(self, asking: str = "auto", temperature: float = 0.0) -> "Profile":
        """The pair's profile for this rank count as rank 0 read it, the same on every rank (its JSON shared once;
        the first call that needs it is the same call on every rank), else `stand_in`. Never a calibration:
        across ranks that is `mirror-mlx tune`'s."""
        if self.auto.profile is None:
            if self.split != "tensor":
                self.auto.profile = stand_in("split by layers across ranks: tune measures the tensor-parallel "
                                             "split only")
            else:
                self.auto.profile = self._shared_profile()
        return self.auto.profile

    def _shared_profile(self) -> "Profile":
        sent = list(self._read_profile()) if self.group.rank() == 0 else []
        size = self.agree([len(sent)], 1, "rank 0's tuning profile")[0]
        if not size:
            return stand_in("no tuning profile for these ranks: `mirror-mlx tune` under the launcher makes one")
        prof = Profile(**json.loads(bytes(self.agree(sent, size, "rank 0's tuning profile"))))
        prof.why = f"the tuned profile of {self.group.size()} ranks, {describe(prof)}: {prof.why}"
        return prof

    def _read_profile(self) -> bytes:
        """Rank 0: this pair's profile for this rank count as JSON, or b"" (none, or a broken one, said)."""
        try:
            prof = profiles.saved(profiles.pipe_key(self), self.engine)
        except profiles.ProfileError as e:
            print(f"mirror-mlx: {e}; the uncalibrated knobs run", file=sys.stderr)
            return b""
        return b"" if prof is None else json.dumps(asdict(prof)).encode()

    def _chunks(self, plan: "Plan", hold: bool = False,
                detokenizer: Optional[Detokenizer] = None) -> Generator[Chunk, None, None]:
        """The steps, each timed by the watchdog; a lost peer ends this rank with one line."""
        steps = super()._chunks(plan, hold, detokenizer)
        try:
            while True:
                with self.watchdog.waiting("a step of the other ranks"):
                    try:
                        chunk = collective(lambda: next(steps))
                    except StopIteration:
                        return
                yield chunk
        finally:
            steps.close()

    # --- a server across ranks: rank 0 leads (these overrides), the other ranks `follow`

    def run(self, plan: "Plan", detokenizer: Optional[Detokenizer] = None) -> Generator[Chunk, None, None]:
        """Leading: the request (its ids and options) goes to the other ranks first, then each step is told
        before it runs, so every rank runs the same generation step by step (the text is this rank's own:
        `detokenizer` stays here)."""
        if not self.leading:
            return super().run(plan, detokenizer)
        if plan.prompt_cache is not None:
            raise ValueError(NO_PROMPT_CACHE)
        try:
            options = json.dumps(given(plan.asked)).encode()
        except TypeError as e:
            raise ValueError(f"these options cannot be sent to the other ranks ({e}): give plain values") from None
        ids = list(plan.ids)
        with self._talk:
            self._busy = True
            self._tell(START, len(ids), len(options), *held(self))
            with self.watchdog.waiting("the other ranks to take the request"):
                collective(lambda: share(ids + list(options), len(ids) + len(options), self.group))
        try:
            chunks = super().run(plan, detokenizer)
        except BaseException:  # the other ranks failed to start it alike (the same check on the same input)
            self._idle()
            raise
        return self._lead(chunks)

    def _lead(self, chunks: Generator[Chunk, None, None]) -> Generator[Chunk, None, None]:
        ended = False  # the other ranks saw the end too (their stream ended at the same chunk)
        try:
            while not ended:
                self._tell(STEP)
                chunk = next(chunks, None)
                ended = chunk is None or chunk.finish_reason is not None
                if chunk is not None:
                    yield chunk
        finally:
            if not ended:  # closed early (a client went away, a stop string, shutdown) or failed
                self._tell(STOP)
            chunks.close()
            self._idle()

    def reset(self) -> None:
        if self.leading:
            self._tell(RESET)
        super().reset()

    def close(self) -> None:
        if self.leading and not self._closed:
            with self._talk:
                self.leading = False
                self._tell(QUIT)
        super().close()

    def lead(self) -> None:
        """Rank 0 of a server: tell the other ranks each request and step (`follow`), and while no request runs
        tell them IDLE every IDLE_TICK_S s, so that they wait between ticks asleep: a rank waiting in a
        collective keeps a core busy (MLX's ring backend polls its sockets)."""
        self.leading, self._talk, self._told = True, threading.RLock(), time.monotonic()
        threading.Thread(target=self._tick_while_idle, name="mirror-idle-tick", daemon=True).start()

    def _tick_while_idle(self) -> None:
        while self.leading:
            time.sleep(IDLE_TICK_S)
            with self._talk:
                if self.leading and not self._busy and time.monotonic() - self._told >= IDLE_TICK_S:
                    self._tell(IDLE)

    def _idle(self) -> None:
        with self._talk:
            self._busy, self._told = False, time.monotonic()

    def _tell(self, kind: int, *args: int) -> None:
        with self._talk, self.watchdog.waiting("the other ranks to follow"):
            collective(lambda: share([kind, *args], MESSAGE, self.group))
            self._told = time.monotonic()


KEPT = "across ranks auto keeps this choice (adapting to auto's runs and leaving the draft are off)"


def stand_in(reason: str) -> "Profile":
    """The profile across ranks without a tuned one: mirror with the small safe knobs, said uncalibrated with
    `reason`. Its table is empty, so an explicit mode's missing knobs are the safe ones too (policy.knobs_from)."""
    safe = "; ".join(f"{knob} {value} (small safe default, uncalibrated)" for knob, value in SAFE_KNOBS.items())
    return Profile(key={}, mode="mirror", kappa=SAFE_KNOBS["kappa"], gamma=SAFE_KNOBS["gamma"],
                   why=f"mirror ({reason}); {safe}")


START, STEP, STOP, RESET, QUIT, IDLE = 1, 2, 3, 4, 5, 6  # what rank 0 of a server tells the others: [kind, ...]
IDLE_TICK_S = 0.25  # rank 0 of an idle server tells IDLE this often; the other ranks sleep IDLE_SLEEP_S after each
IDLE_SLEEP_S = 0.2  # (so a request that comes to an idle server waits up to this long more for them)
MESSAGE = 5  # [START, prompt ids, option bytes, tokens the target's cache holds, their checksum]; else [kind]


def held(pipe: Pipeline) -> list[int]:
    """What the target's cache holds before a request: its token count and a checksum. Every rank must hold
    the same (the same requests ran, the prefix cache restored the same entry)."""
    cached = pipe.engine.with_target(lambda target: list(target.cached))
    return [len(cached), sum((i + 1) * t for i, t in enumerate(cached)) % (1 << 31)]


def load(model: Union[str, Path], draft_model: Optional[Union[str, Path]] = None,
         exit_adapter: Optional[Union[str, Path]] = None, *, adapter_path: Optional[Union[str, Path]] = None,
         tokenizer_config: Optional[dict] = None, trust_remote_code: bool = False, pipeline: bool = False,
         g: Optional[mx.distributed.Group] = None, draft_vocab: Optional[int] = None) -> DistributedPipeline:
    """`mirror_mlx.load` on every rank of the launcher's group: this rank's shard of the target (mlx-lm's
    `sharded_load`), the draft host on rank 0 only. Every rank must then make the same calls.

    The split is sharded_load's: tensor parallel where the family has `model.shard`, else its pipeline split
    (layers by rank); `pipeline=True` asks for the pipeline split (mlx-lm's `--pipeline`)."""
    if str(draft_model) == LOOKUP:
        raise ValueError(NO_LOOKUP)
    validate.draft_vocab(draft_vocab, draft_model is not None)
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
    draft = load_draft(draft_model, tokenizer, draft_vocab) if draft_model is not None else None
    adapter = None
    if exit_adapter is not None:
        # checked against the whole model's fingerprint (a shard's shapes differ); lazy: only what it reads
        adapter = load_adapters(exit_adapter, load_model(folder, lazy=True, strict=False)[0])
    watchdog = Watchdog(float(os.environ.get(TIMEOUT_ENV, "120")))
    if threading.current_thread() is threading.main_thread():  # (only the main thread may set handlers)
        for sig in (signal.SIGTERM, signal.SIGHUP):  # mlx.launch stops the others with SIGTERM when one fails
            signal.signal(sig, on_stop_signal)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # (not where SIGINT is ignored)
            signal.signal(signal.SIGINT, on_interrupt)
    rank = g.rank()
    pipe = DistributedPipeline(target, tokenizer, draft if rank == 0 else None, adapter, name=str(model))
    pipe.group, pipe.watchdog = g, watchdog
    engine = pipe.engine
    if getattr(text_model(target).model, "pipeline_size", 1) > 1:  # layers by rank: block ℓ_e on one stage
        pipe.split = "pipeline"
        engine.n_layers = share([len(text_model(target).model.layers)], 1, g)[0]  # (rank 0 holds the last block)
        engine.replace_target(StageTargetSide, target, g, engine.n_layers)
    engine.local_build = None  # sd drafts through the host too: rank 0's window must reach every rank
    if draft is not None:
        if rank == 0:
            engine.host = SharedHost(engine.host, g, watchdog)
        else:
            pipe.draft = engine.draft = draft
            engine.draft_context = draft_context(draft)
            engine.host = MirrorHost(g, engine.vocab_size, watchdog)
    share([1], 1, g)  # every rank loaded (rank 0 started its draft host): the watchdog times steps from here
    return pipe


def quiet_other_ranks() -> None:
    """The command line on ranks > 0: nothing on stdout or stderr but `die`'s line (rank 0 prints and serves)."""
    g = group()
    if g is None or g.rank() == 0 or os.environ.get("MIRROR_MLX_DIST_VERBOSE") == "1":  # (verbose: debugging)
        return
    sys.stdout = sys.stderr = open(os.devnull, "w")

    def hook(kind, value, tb) -> None:
        os.write(2, f"mirror-mlx: rank {g.rank()}: {kind.__name__}: {value}\n".encode())

    sys.excepthook = hook
