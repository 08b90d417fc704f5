"""The scheduler: one request alone runs as the pipeline runs it (mode auto: speculation where it pays);
several decode together through mlx-lm's own BatchGenerator (continuous batching: requests join and
leave at step boundaries). One thread drives both, so the engine is never used by two at once.

Switches happen at step boundaries and are decided by measured cost (`Costs`): with n requests active,
batching pays when n tokens per batched step (its measured time at n rows) beat the tokens/s that the
request decoding alone measures. A request that was speculating moves into the batch with its target
cache (the engine's cache holds every committed token but the pending one: BatchGenerator.insert takes
it, with the pending token as its one-token prompt, so nothing is prefilled again); the draft's state is
dropped. When the batch drains to one request, it goes back to decoding alone when that measured faster
(or when it asked for a mode): its cache comes out of the batch, and the draft host catches up on the
committed tokens (its usual sync from the common prefix). Every step's output is the target's own
token at each row, so each request's tokens are what it would get alone (see docs/design.md §6);
seeded draws are keyed by (seed, position) in both regimes (mirror_mlx.engine.sampling.position_seed).
"""

import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Optional

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from ..chunks import Chunk, Detokenizer
from ..options import Plan
from ..pipeline import Pipeline
from ..engine.sampling import keyed, samplers
from ..engine.stats import Stats, Step
from ..engine.target import TargetSide
from ..text import Conversation
from .prefix_cache import PrefixCache
from .request import APIError
from .spec_batch import Out, SpecBatch, supports

DECODE_CONCURRENCY, PROMPT_CONCURRENCY = 32, 8  # mlx_lm.server's defaults


@dataclass
class Job:
    """One admitted request as the scheduler runs it; the handler reads `events` (Chunks, then None, or an
    exception) and sets `cancelled` when its client went away."""

    plan: Plan  # checked when it came in (Pipeline.check): read, never rebuilt
    messages: Optional[list] = None  # chat: remembered as the pipeline's conversation when it ends
    logprobs: bool = False  # the handler scores each token's row (else no row is kept)
    events: "queue.Queue" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: list[int] = field(default_factory=list)  # committed tokens, an end-of-sequence token included
    regimes: list[str] = field(default_factory=list)  # what decoded it, in order: a mode name or "batch"
    cached: int = 0  # prompt tokens not prefilled (a cache held them)
    restored: int = 0  # of them, from the prefix cache across requests (PrefixCache)
    batched_tokens: int = 0
    batch_steps: int = 0  # batched steps it took part in
    batch_accepted: int = 0  # of its batched tokens, those its windows proposed (speculation in the batch)
    stats: Optional[Stats] = None  # its last run alone
    finish_reason: Optional[str] = None
    uid: Optional[int] = None  # in the batch
    stream: Optional[Generator[Chunk, None, None]] = None  # alone: the pipeline's stream
    detok: Optional[Detokenizer] = None
    said: list[str] = field(default_factory=list)  # the text so far
    t0: float = field(default_factory=time.perf_counter)
    t_decode: Optional[float] = None  # when it began decoding (alone or batched)
    told: int = 0  # the scheduler logged that batching `told` requests did not pay
    admitted_step: int = 0  # batched steps run before it was admitted
    first_token_steps: Optional[int] = None  # batched steps from its admission to its first token

    @property
    def ids(self) -> list[int]:
        return self.plan.ids

    @property
    def max_tokens(self) -> int:
        return self.plan.opts.max_tokens

    def note(self, regime: str) -> None:
        if self.t_decode is None:
            self.t_decode = time.perf_counter()
        if not self.regimes or self.regimes[-1] != regime:
            self.regimes.append(regime)

    def x_stats(self) -> dict:
        """What the reply's x_mirror says: the last run alone's stats (if any) and the regimes."""
        out = dict((self.stats or Stats(mode="batch")).as_dict(), generation_tokens=len(self.generated),
                   regimes=list(self.regimes), batched_tokens=self.batched_tokens, batch_steps=self.batch_steps,
                   batch_accepted=self.batch_accepted, steps_to_first_token=self.first_token_steps)
        if self.batched_tokens and self.t_decode is not None:  # its own rate over both regimes
            out["tokens_per_second"] = len(self.generated) / max(1e-9, time.perf_counter() - self.t_decode)
        return out


class Costs:
    """Measured step costs for the switch decisions (kept visible in /health and the log)."""

    def __init__(self) -> None:
        self.batch_step: dict[int, float] = {}  # rows → seconds per batched decode step (running mean)
        self.batch_tokens: dict[int, float] = {}  # rows → tokens committed per batched step (speculation: > rows)
        self.solo_rate: Optional[float] = None  # tokens/s of requests decoding alone (running mean)
        self.solo_forward: Optional[float] = None  # seconds per target forward alone (a batched step's prior)

    def note_batch(self, rows: int, seconds: float, tokens: Optional[int] = None) -> None:
        old = self.batch_step.get(rows)
        self.batch_step[rows] = seconds if old is None else 0.8 * old + 0.2 * seconds
        tokens, old = rows if tokens is None else tokens, self.batch_tokens.get(rows)
        self.batch_tokens[rows] = tokens if old is None else 0.8 * old + 0.2 * tokens

    def tokens(self, rows: int) -> float:
        """Tokens per batched step at `rows` rows: as measured there (speculation commits more), else one a row."""
        return self.batch_tokens.get(rows, rows)

    def note_solo(self, stats: Stats) -> None:
        if stats.generation_tokens >= 4 and stats.decode_seconds > 0:
            rate = stats.generation_tokens / stats.decode_seconds
            self.solo_rate = rate if self.solo_rate is None else 0.7 * self.solo_rate + 0.3 * rate
        forwards = stats.target_forwards
        if forwards:
            t = (stats.prefix_seconds + stats.suffix_seconds) / forwards or stats.decode_seconds / forwards
            self.solo_forward = t if self.solo_forward is None else 0.7 * self.solo_forward + 0.3 * t

    def step(self, rows: int) -> tuple[Optional[float], str]:
        """Seconds per batched step at `rows` rows: measured; else the nearest measured size's; else what one
        forward alone measured (a forward over a few rows costs about one over one, until measured)."""
        if rows in self.batch_step:
            return self.batch_step[rows], "measured"
        if self.batch_step:
            near = min(self.batch_step, key=lambda n: (abs(n - rows), -n))
            return self.batch_step[near], f"as measured at {near} rows"
        return self.solo_forward, "one forward alone's"

    def batch_pays(self, rows: int, solo_rate: Optional[float]) -> tuple[bool, str]:
        """Whether `rows` requests decode more tokens/s batched than one at a time alone, and why."""
        t, how = self.step(rows)
        if t is None or solo_rate is None:
            return True, f"{rows} requests: batched (no measurement alone yet)"
        n = self.tokens(rows)
        batched = n / t
        pays = batched >= solo_rate
        what = f"{rows} rows" if n == rows else f"{n:.1f} tokens ({rows} rows)"
        return pays, (f"{rows} requests: {'batched' if pays else 'one at a time'} ({what} / "
                      f"{t * 1e3:.2f} ms per step ({how}) = {batched:.0f} tok/s vs {solo_rate:.0f} tok/s alone)")

    def solo_pays(self) -> tuple[bool, str]:
        """Whether the one request left decodes faster alone than as a batch of one, and why."""
        t = self.batch_step.get(1)
        if t is None or self.solo_rate is None:
            return True, "one request: alone (not measured both ways yet)"
        rate = self.tokens(1) / t
        pays = self.solo_rate > rate
        return pays, (f"one request: {'alone' if pays else 'stays batched'} ({self.solo_rate:.0f} tok/s alone vs "
                      f"{rate:.0f} tok/s as a batch of one)")

    def as_dict(self) -> dict:
        return {"batch_step_ms": {str(n): round(t * 1e3, 3) for n, t in sorted(self.batch_step.items())},
                "batch_step_tokens": {str(n): round(t, 2) for n, t in sorted(dict(self.batch_tokens).items())},
                "solo_tokens_per_second": None if self.solo_rate is None else round(self.solo_rate, 1)}


class Scheduler:
    """Runs admitted jobs on one thread: alone through the pipeline, or batched in mlx-lm's BatchGenerator."""

    def __init__(self, pipe: Pipeline, prefixes: Optional[PrefixCache], note: Callable[[str], None],
                 max_queue: int = 32, decode_concurrency: int = DECODE_CONCURRENCY,
                 prompt_concurrency: int = PROMPT_CONCURRENCY, prefill_step_size: int = 2048,
                 batch_speculation: bool = True):
        self.pipe, self.prefixes, self.note = pipe, prefixes, note
        self.engine = pipe.engine  # its doors only: on_target, with_target
        self.max_queue, self.decode_concurrency = max_queue, decode_concurrency
        self.prompt_concurrency, self.prefill_step_size = prompt_concurrency, prefill_step_size
        self.costs = Costs()
        self.counts = {"solo_steps": 0, "batch_steps": 0, "max_batch": 0, "joins": 0, "moves_in": 0,
                       "moves_out": 0, "freed": 0, "freed_in_batch": 0,
                       "moves_prefilled": 0}  # moves whose cache could not be carried over (none expected)
        self.regime = "idle"
        self._cond = threading.Condition()
        self._inbox: deque = deque()
        self.waiting: deque = deque()  # admitted, not yet decoding (scheduler thread only)
        self.solo: Optional[Job] = None
        self.batch: dict[int, Job] = {}  # uid → job
        self._gen: Any = None  # the SpecBatch or BatchGenerator, made on the target's thread
        self.speculation: Optional[bool] = batch_speculation if not batch_speculation else None  # None: not yet known
        self.speculation_why = "" if batch_speculation else "off (--batch-speculation off)"
        self.spec_counts: dict = {}  # the last SpecBatch's counts, kept when it closes
        self._closed = False
        self._seconds = 1.0  # running mean of a request's time, for Retry-After
        self._thread = threading.Thread(target=self._run, name="serve-scheduler", daemon=True)
        self._thread.start()

    # --- the handlers' side

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._inbox) + len(self.waiting)

    def submit(self, job: Job) -> None:
        """Admit a job, or raise 429 (the wait list is full) / 503 (shutting down)."""
        with self._cond:
            if self._closed:
                raise APIError(503, "the server is shutting down", kind="server_error", code="shutting_down")
            queued = len(self._inbox) + len(self.waiting)
            active = (self.solo is not None) + len(self.batch)
            if active + queued >= self.decode_concurrency + self.max_queue:  # (memory: bounded by both)
                retry = max(1, int(self._seconds * (queued + 1) / max(1, len(self.batch) or 1) + 0.999))
                raise APIError(429, f"the queue is full ({self.max_queue} requests waiting): retry in {retry} s",
                               kind="rate_limit_error", code="queue_full", retry_after=retry)
            job.admitted_step = self.counts["batch_steps"]
            self._inbox.append(job)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(60)

    def health(self) -> dict:
        spec = self._gen.health() if isinstance(self._gen, SpecBatch) else self.spec_counts
        return {"regime": self.regime, "active": (self.solo is not None) + len(self.batch),
                "scheduler": dict(self.counts, decode_concurrency=self.decode_concurrency,
                                  prompt_concurrency=self.prompt_concurrency, costs=self.costs.as_dict(),
                                  batch_speculation=dict(spec, on=self.speculation, why=self.speculation_why))}

    # --- the scheduler thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._inbox and not self.waiting and self.solo is None and not self.batch \
                        and not self._closed:
                    self.regime = "idle"
                    self._cond.wait()
                self.waiting.extend(self._inbox)
                self._inbox.clear()
                closed = self._closed
            if closed:
                self._abandon(APIError(503, "the server is shutting down", kind="server_error", code="shutting_down"))
                return
            try:
                self._tick()
            except Exception as e:  # a bug of ours: every job in flight gets it, the server keeps serving
                self.note(f"scheduler failed: {traceback.format_exc().rstrip()}")
                self._abandon(e, waiting=False)
                self._reset_engine()

    def _abandon(self, error: BaseException, waiting: bool = True) -> None:
        """End the jobs in flight (and those waiting) with `error`; the pipeline's stream is closed first."""
        if self.solo is not None and self.solo.stream is not None:
            try:
                self.solo.stream.close()
            except Exception:  # noqa: BLE001 - it failed already; the job gets `error`
                pass
        jobs = ([self.solo] if self.solo else []) + list(self.batch.values()) + (list(self.waiting) if waiting else [])
        for job in jobs:
            self._end(job, error)
        if waiting:
            self.waiting.clear()
        self.solo, self.batch = None, {}
        self._close_batch()

    def _tick(self) -> None:
        self._drop_cancelled()
        if self.solo is None and not self.batch:
            if not self.waiting:
                return
            n = min(len(self.waiting), self.decode_concurrency)
            pays, why = self.costs.batch_pays(n, self.costs.solo_rate) if n > 1 else (False, "")
            if pays:
                self.note(f"scheduler: {why}")
                self._fill()
            else:
                self._start_solo(self.waiting.popleft())
        if self.solo is not None:
            self._step_solo()
            job = self.solo
            if job is not None and self.waiting and self.decode_concurrency > 1:
                rate = job.stats.generation_tokens / job.stats.decode_seconds \
                    if job.stats and job.stats.decode_seconds else self.costs.solo_rate
                n = min(1 + len(self.waiting), self.decode_concurrency)
                pays, why = self.costs.batch_pays(n, rate)
                if not pays and job.told != n:  # (once per count of waiting requests, not every step)
                    job.told = n
                    self.note(f"scheduler: {why}: the others wait for the request decoding alone")
                if pays:
                    self.note(f"scheduler: {why}: the request decoding alone moves into the batch")
                    self._solo_to_batch(job)
                    self._fill()
            return
        if self.batch:
            self.counts["joins"] += self._fill()
            self._step_batch()
            if len(self.batch) == 1 and not self.waiting and not self._inbox:
                [job] = self.batch.values()
                if job.plan.asked.mode != "auto":
                    pays, why = True, f"one request: alone, in the mode it asked for ({job.plan.asked.mode})"
                else:  # (after one step as a batch of one, so both ways are measured)
                    pays, why = self.costs.solo_pays() if 1 in self.costs.batch_step else (False, "")
                if pays:
                    self.note(f"scheduler: {why}")
                    self._batch_to_solo(job)

    # --- alone

    def _start_solo(self, job: Job, resumed: bool = False) -> None:
        """Decode `job` through the pipeline as a request alone (after its committed tokens, if any)."""
        plan = job.plan.after(job.generated)
        restored = self.prefixes.restore(plan.ids) if self.prefixes is not None and not resumed else 0
        try:
            job.stream = self.pipe.run(plan, self._detokenizer(job))
        except Exception as e:  # (checked when admitted: a bug or a dead engine)
            self._end(job, e)
            return
        job.restored = max(job.restored, restored)
        self.solo = job
        self.regime = "solo"

    def _step_solo(self) -> None:
        job = self.solo
        assert job is not None and job.stream is not None, "a step alone runs the solo job's stream"
        try:
            chunk = next(job.stream, None)
        except Exception as e:
            self.solo = None
            job.stream = None
            self._end(job, e)
            self._reset_engine()
            return
        stats = self.pipe.stats
        if chunk is None:  # (a stream always ends with a finished chunk; this is its end)
            self._finish_solo(job)
            return
        job.stats = stats
        if not job.generated:
            job.cached = max(job.cached, stats.prompt_tokens - 1 - stats.prefill_tokens)
        job.note(stats.mode)
        self.counts["solo_steps"] += 1
        self._emit(job, chunk.committed, chunk.from_draft + [chunk.stop_from_draft] * (chunk.stop_token is not None),
                   chunk.committed_logprobs, chunk.stop_token, (chunk.token_texts, chunk.text, chunk.finish_reason),
                   chunk.step)
        if chunk.finish_reason is not None:
            self._finish_solo(job)

    def _leave_solo(self, job: Job) -> None:
        """The request decoding alone stops at this step boundary; its run's rate is noted for the switches."""
        assert job.stream is not None, "a job alone has its stream"
        job.stream.close()
        job.stream = None
        self.solo = None
        if job.stats is not None:
            self.costs.note_solo(job.stats)

    def _finish_solo(self, job: Job) -> None:
        self._leave_solo(job)
        if self.prefixes is not None:
            self.prefixes.store()
        self._end(job)

    # --- the switches

    def _solo_to_batch(self, job: Job) -> None:
        """At a step boundary: the engine's target cache goes into the batch with the pending token as the
        prompt; the draft's state is dropped (it re-syncs when a request next decodes alone)."""
        self._leave_solo(job)
        committed = job.ids + job.generated
        cache = self.engine.with_target(TargetSide.give, committed[:-1])
        self.counts["moves_in"] += 1
        if cache is None:
            self.counts["moves_prefilled"] += 1
            self.note("scheduler: the engine's cache did not hold the committed tokens: the batch prefills them")
        self._insert(job, cache, committed)

    def _batch_to_solo(self, job: Job) -> None:
        """The last request in the batch leaves with its cache; the draft catches up on its tokens."""
        committed = job.ids + job.generated
        if not self.engine.with_target(self._cache_from_batch, job.uid, committed[:-1]):
            self.counts["moves_prefilled"] += 1
            self.note("scheduler: the batch's cache did not hold the committed tokens: the target prefills them")
        assert job.uid is not None, "a job in the batch has its uid"
        del self.batch[job.uid]
        job.uid = None
        self.counts["moves_out"] += 1
        self._start_solo(job, resumed=True)

    def _cache_from_batch(self, target: TargetSide, uid: int, held: list[int]) -> bool:
        """The engine's target cache becomes the batch row's, trimmed to `held` (it holds every committed token:
        the pending one is the engine's to run). Whether it could."""
        [(cache, tokens)] = self._gen.remove([uid], return_prompt_caches=True).values()
        target.reset()
        if len(tokens) < len(held) or list(tokens[: len(held)]) != held or any(c.offset != len(tokens) for c in cache):
            return False
        for c in cache:
            c.trim(c.offset - len(held))
        target.take(cache, held)
        return True

    # --- batched

    def _generator(self) -> Any:
        if self.speculation is None:  # (once: whether this model's caches let each row drop its own tokens)
            self.speculation, why = supports(self.pipe.model)
            self.speculation_why = "on" if self.speculation else f"off: {why} (the batch decodes without it)"
            self.note(f"scheduler: speculation in the batch {self.speculation_why}")
        if self._gen is None and self.speculation:
            self._gen = SpecBatch(self.pipe.model, self.prompt_concurrency, self.prefill_step_size,
                                  recycled=self.pipe.recycled)
        if self._gen is None:
            self._gen = BatchGenerator(self.pipe.model, completion_batch_size=self.decode_concurrency,
                                       prefill_batch_size=self.prompt_concurrency,
                                       prefill_step_size=self.prefill_step_size,
                                       stream=mx.default_stream(mx.default_device()))
        return self._gen

    def _insert(self, job: Job, cache: Optional[list] = None, committed: Optional[list[int]] = None) -> None:
        """Into the batch: with the target's cache of `committed[:-1]`, or from the prefix cache, or fresh."""
        opts = job.plan.opts
        committed = job.ids + job.generated if committed is None else committed
        held = len(committed) - 1 if cache is not None else 0
        if cache is None and self.prefixes is not None and self.prefixes.lru is not None and not job.generated:
            cache, rest = self.engine.on_target(  # (its copy is made on the target's thread)
                self.prefixes.lru.fetch_nearest_cache, self.prefixes.KEY, committed[:-1])
            held = len(committed) - 1 - len(rest) if cache is not None else 0
            job.cached = job.restored = held
        base, processors = samplers(opts)  # as Engine.generate
        sampler = keyed(base, opts.seed, len(committed))  # (the seed as checked: mapped into the generator's range)

        stops = StopSequences([(t,) for t in opts.stop_tokens] or None)
        left = job.max_tokens - len(job.generated)

        def insert() -> int:
            if isinstance(self._generator(), SpecBatch):
                uid = self._gen.insert(committed, held, cache, opts, left)
            else:
                [uid] = self._gen.insert([committed[held:]], max_tokens=[left],
                                             caches=[cache] if cache is not None else None,
                                         all_tokens=[committed[:held]], samplers=[sampler],
                                         logits_processors=[processors], stop_sequences=[stops])
            if self.prefixes is not None:
                self.prefixes.give_way(self._gen.prompt_cache_nbytes)
            return uid

        job.uid = self.engine.on_target(insert)
        job.note("batch")
        self.batch[job.uid] = job
        self.counts["max_batch"] = max(self.counts["max_batch"], len(self.batch))
        self.regime = "batch"

    def _fill(self) -> int:
        """Waiting requests join the batch while it has room; how many joined."""
        n = max(0, min(len(self.waiting), self.decode_concurrency - len(self.batch)))
        for _ in range(n):
            self._insert(self.waiting.popleft())
        return n

    def _step_batch(self) -> None:
        gen = self._gen
        # mlx-lm's BatchGenerator counts its decoding rows privately: ours are the jobs in the batch, so a step that
        # decoded one token for each of them (no prefill) is a decode step of that many rows
        rows = len(gen) if isinstance(gen, SpecBatch) else len(self.batch) if gen is not None else 0

        def step() -> tuple[bool, list[Out], tuple[float, float]]:
            t = time.perf_counter()
            if isinstance(gen, SpecBatch):
                prefilled, outs = gen.next()
            else:
                prompts, gens = gen.next()
                prefilled, outs = bool(prompts), [Out(g.uid, [g.token], [False], [g.logprobs], g.finish_reason,
                                                      g.prompt_cache, g.all_tokens) for g in gens]
            return prefilled, outs, (t, time.perf_counter())

        prefilled, outs, span = self.engine.on_target(step)
        seconds = span[1] - span[0]
        if outs and not prefilled and rows == len(outs):
            self.costs.note_batch(rows, seconds, sum(len(o.tokens) for o in outs))
        if outs:
            self.counts["batch_steps"] += 1
        for out in outs:
            uid, finish, cache, tokens = out.uid, out.finish, out.cache, out.all_tokens
            job = self.batch.get(uid)
            if job is None:
                continue
            job.batched_tokens += len(out.tokens)
            job.batch_steps += 1
            job.batch_accepted += sum(out.drafted)
            stop = out.tokens[-1] if finish == "stop" else None
            batched = Stats(mode="batch", steps=1, target_forwards=1, generation_tokens=len(out.tokens),
                            accepted=sum(out.drafted), suffix_seconds=seconds)
            self._emit(job, out.tokens, out.drafted, out.logprobs, stop,
                       step=Step(out.tokens, out.drafted, stats=batched, span=span))
            if finish is not None:
                del self.batch[uid]
                if self.prefixes is not None and self.prefixes.lru is not None and cache is not None:
                    self.engine.on_target(self.prefixes.lru.insert_cache, self.prefixes.KEY, list(tokens), cache)
                self._end(job)

    def _close_batch(self) -> None:
        if self._gen is not None:
            gen, self._gen = self._gen, None
            if isinstance(gen, SpecBatch):
                self.spec_counts = gen.health()
            try:
                self.engine.on_target(gen.close)
            except Exception:  # noqa: BLE001 - the engine is closing anyway
                pass

    def _drop_cancelled(self) -> None:
        """A client that went away frees its slot at this step boundary."""
        if self.solo is not None and self.solo.cancelled.is_set():
            job, self.solo = self.solo, None
            assert job.stream is not None, "a job alone has its stream"
            job.stream.close()
            job.stream = None
            self.counts["freed"] += 1
            self._end(job)
        gone = [uid for uid, job in self.batch.items() if job.cancelled.is_set()]
        if gone:
            self.engine.on_target(self._gen.remove, gone)
            for uid in gone:
                self.counts["freed"] += 1
                self.counts["freed_in_batch"] += 1
                self._end(self.batch.pop(uid))
        for job in [j for j in self.waiting if j.cancelled.is_set()]:
            self.waiting.remove(job)
            self._end(job)

    # --- output

    def _detokenizer(self, job: Job) -> Detokenizer:
        """The request's one detokenizer, across its switches between alone and the batch."""
        if job.detok is None:
            job.detok = Detokenizer(self.pipe.tokenizer, job.max_tokens, job.plan.opts.stop_tokens)
        return job.detok

    def _emit(self, job: Job, ids: list[int], from_draft: list[bool], rows: list, stop: Optional[int],
              said: Optional[tuple[list[str], str, Optional[str]]] = None, step: Optional[Step] = None) -> None:
        """Committed tokens as a Chunk for the handler, in the request's own detokenizer: `said` is the
        pipeline's (texts, text, finish) when it detokenized them (alone), else (the batch) they are here;
        `step`: the step that committed them (the engine's, or the batch's row)."""
        job.generated += ids
        if job.first_token_steps is None:
            job.first_token_steps = self.counts["batch_steps"] - job.admitted_step
        if job.logprobs:
            mx.eval(rows)  # (made on this thread: the handler's thread cannot evaluate this thread's graph)
        else:
            rows = [None] * len(ids)
        shown = [(t, d, r) for t, d, r in zip(ids, from_draft, rows) if t != stop]
        if said is None:
            texts, tail, finish = self._detokenizer(job).add(ids, stop)
            text = "".join(texts) + tail
        else:
            texts, text, finish = said
        texts = list(texts) if texts or finish is None else [text]
        if finish is not None:
            job.finish_reason = finish
        job.said.append(text)
        job.events.put(Chunk(text, tokens=[t for t, _, _ in shown], from_draft=[d for _, d, _ in shown],
                             finish_reason=finish, stop_token=stop, prompt_tokens=len(job.ids),
                             generation_tokens=len(job.generated), token_texts=texts,
                             logprobs=[r for _, _, r in shown], stop_logprobs=rows[-1] if stop is not None else None,
                             step=step))

    def _end(self, job: Job, error: Optional[BaseException] = None) -> None:
        if error is None and job.messages is not None:
            self._remember(job)
        self._seconds = 0.8 * self._seconds + 0.2 * (time.perf_counter() - job.t0)
        job.events.put(error)  # None: the end

    def _remember(self, job: Job) -> None:
        """A chat's turn is the pipeline's conversation (its ids as committed), as Pipeline.chat leaves it."""
        assert job.messages is not None, "only a chat's turn is remembered"
        stop = job.generated[-1] if job.finish_reason == "stop" and job.generated else None
        text = "".join(job.said)
        self.pipe.conversation = Conversation(list(job.messages) + [{"role": "assistant", "content": text}],
                                              job.ids + job.generated, stop)

    def _reset_engine(self) -> None:
        try:
            self.pipe.reset()
        except Exception as e:  # noqa: BLE001 - the next request will show it too; the server stays up
            self.note(f"could not clear the caches after the failure: {e!r}")
