"""The Mirror-SD generation loop (docs/design.md §3-4), one code path for `mirror`, `sd` and `ar`: begin →
prefill → each step the call's proposer (proposers/proposer.py, chosen once) proposes and the target verifies →
commit.

State between steps: `committed` holds every committed token; the target's cache holds all but the last
(the *pending* token); `window` holds the γ draft tokens proposed after it.

mirror: target prefix over [pending, ŷ1..ŷγ] → early-exit top-κ sets on the ring → (target suffix ‖ the
        draft host rolls out every branch, or the top B: branch_budget.py) → verify → reuse or fallback;
        with the lookup, its window (if any) replaces a fallback's serial rollout.
sd:     the draft rolls out one window, then the target verifies it (serial); with the lookup, the
        context's continuation (lookup.py) is the window where it offers one, at no draft cost.
ar:     the target alone, one token per forward.
Every committed token is the target's own choice given the committed prefix, so every mode returns what
the target alone would. Each step returns a StepRecord; a generation's Stats is the sum of theirs. The
proposers call the target's forwards and the draft's windows here (`verify`, `verify_tree`, `sd_step`,
`mirror_step`, `rollout`); a draft that fails or is left hands over to the proposer's `alone()`.

The draft lives behind a DraftHost (drafts/host.py): the scheduler posts on the ring and awaits windows.
One exception: sd with an MLX draft drafts on the target's own thread (a serial window hides nothing, so a
ring round trip would only add to it). The scheduler is an asyncio loop on its own thread, so the
synchronous API also works from inside a running event loop.
"""

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from concurrent.futures import Future
from contextlib import suppress
from typing import Callable, Generator, Optional, Sequence, TypeVar, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..drafts.host import DraftHost

from ..drafts.recipes import DraftRecipe, mlx_draft, ss_draft
from .branch_budget import BranchBudget, ExitView, spread, stems as branch_stems
from ..drafts.mlx_draft import MLXDraft
from ..drafts.api import Draft
from ..drafts.vocab import head_rows
from .exit_adapter import ExitAdapter, ExitAdapters, adapter_for
from ..proposers.lookup import Lookup
from ..proposers.proposer import PROPOSERS, Generating, Mirror, Proposer, RecycledTree, StepRecord
from ..proposers.proposing import Proposing
from ..proposers.recycle import RECYCLE, Recycled
from .tree import Tree, Walk, takes_tree
from ..options import DRAFT_TIMEOUT_S, DecodeOptions, default_exit_layer
from ..prompt_cache import PromptCache
from .sampling import row_sampler, samplers
from .stats import Stats, Step
from .model_parts import family, text_model, vocab_size
from .target import TargetSide
from .workers import LoopThread, Worker


T = TypeVar("T")


@dataclass
class Generation:
    """One generation's state between steps: what is committed, what proposes the next step, what steps need."""

    opts: DecodeOptions
    committed: list[int]
    mode: str  # the next step's: mirror, sd or ar (after a dropped draft, or leave_draft)
    ran: str  # what Stats calls the mode (ar only if the draft never ran)
    draft_host: str  # where the draft model runs: Stats.draft_host ("": none)
    exit_layer: Optional[int]
    proposer: Proposer  # chosen once (Proposing.kind); its `alone()` once the draft is dropped or left
    sampler: Callable[[mx.array, int], list[int]]  # sampling.row_sampler
    processors: list[Callable]
    draft_vocab: Optional[int] = None  # the ids the draft's trimmed head scores (None: its whole vocabulary)
    left: str = ""  # after which step and why it went on with the target alone

    @property
    def gamma(self) -> int:
        """γ, the window a step drafts or looks up: a resolved plan sets it for every mode."""
        assert self.opts.gamma is not None, "a resolved plan's γ is set (tune.policy.resolve)"
        return self.opts.gamma

    def commit(self, new: list[int]) -> int:
        """Commit `new`; how often the lookup held back since the last commit."""
        self.committed += new
        return self.proposer.commit(new)

    def alone(self) -> None:
        """Go on with the target alone (and the lookup, where it proposes)."""
        self.mode, self.proposer = "ar", self.proposer.alone()

    def stats(self, rec: StepRecord, tokens: int, held: int, draft_failure: Optional[str]) -> Stats:
        """A step's Stats: its record's counts, with what describes the generation as it stands."""
        o = self.opts
        return Stats(mode=self.ran, chosen_mode=o.mode, kappa=o.kappa, gamma=o.gamma, exit_layer=self.exit_layer,
                     why=o.why, draft_host=self.draft_host, draft_vocab=self.draft_vocab,
                     draft_failure=draft_failure, left_draft=self.left,
                     placement=o.placement, branches=o.branches, lookup=self.proposer.index is not None, steps=1,
                     recycle=self.proposer.recycle, target_forwards=1, generation_tokens=tokens, lookup_held=held,
                     **rec.counts())


def reuse_window(cand: list[list[int]], windows: list[list[Optional[list[int]]]], a: int,
                 c: int) -> Optional[list[int]]:
    """The precomputed window w(A, c) if the correction c was among row A's candidates (and its branch was
    rolled out, under a branch budget), else None."""
    return windows[a][cand[a].index(c)] if c in cand[a] else None


def cut(tokens: list[int], budget: int, stop_tokens) -> tuple[list[int], bool]:
    """A step's tokens as committed: at most `budget`, none after a stop token; whether one was met."""
    new = tokens[:budget]
    stop = next((i for i, t in enumerate(new) if t in stop_tokens), None)
    return (new, False) if stop is None else (new[: stop + 1], True)


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def _post_or_note(post: Callable, *args: object, failed: list) -> None:
    """Post on the target worker; a failure is noted for the scheduler (which drops the draft), not raised there."""
    try:
        post(*args)
    except Exception as e:  # noqa: BLE001
        failed.append(e)


def _post_budgeted(host: DraftHost, plan: BranchBudget, context: list[int], window: list[int], cand: list[list[int]],
                   view: ExitView) -> None:
    """Post the step's branches: every one (no budget), or the top B by the early exit's score as stems."""
    picked = plan.choose(window, cand, view)
    if picked is None:
        host.post_branches(context, window, cand)
    else:
        host.post_rollout(context, branch_stems(window, cand, picked), len(window))


def draft_context(draft: Union[Draft, DraftRecipe, None]) -> Optional[int]:
    """The draft's context length (γ must fit in it): from its model, or its folder's config.json
    for a draft the host builds; None when unknown (a Core ML package checks its own shapes)."""
    model = getattr(draft, "model", None)
    if model is not None:
        return getattr(getattr(text_model(model), "args", None), "max_position_embeddings", None)
    if isinstance(draft, DraftRecipe) and draft.args:
        with suppress(OSError, ValueError):  # no config.json, or not JSON: unknown
            return json.loads((Path(str(draft.args[0])) / "config.json").read_text()).get("max_position_embeddings")
    return None


def prefill_progress(callback: Optional[Callable[[int, int], None]], given: int):
    """mlx-lm's prompt_progress_callback(done, total) over the `given` prompt tokens, from the prefill's chunks
    of the new ones (the rest came from a cache; the last is the pending token, done with the first step)."""
    return None if callback is None else lambda done, new: callback(max(0, given - 1 - new + done), given)


def local_build(draft: Union[Draft, DraftRecipe, None]) -> Optional[Callable[[], Draft]]:
    """How sd builds its in-process copy of the draft (on the target's thread), or None where sd keeps the
    host: MLX recipes (a Core ML package runs in its host), or a plain MLXDraft (a copy over its weights)."""
    if isinstance(draft, DraftRecipe):
        return partial(draft.build, *draft.args) if draft.build in (mlx_draft, ss_draft) else None
    if type(draft) is MLXDraft:
        return partial(MLXDraft, draft.model, draft.prefill_step_size)
    return None


class Engine:
    """Owns the target worker, the draft host and the scheduler's loop; `generate` yields tokens. `draft`: a
    DraftRecipe (the host process builds it), or a draft object built here (its host loop runs on a thread)."""

    def __init__(self, target_model: nn.Module, draft: Union[Draft, DraftRecipe, None] = None,
                 exit_adapter: Union[ExitAdapter, ExitAdapters, None] = None, named: str = ""):
        self.target_model = target_model
        self.named = named  # "lookup" or "recycle": no draft model (`proposing`)
        self.n_layers = len(text_model(target_model).layers)
        self.context_length = getattr(getattr(text_model(target_model), "args", None), "max_position_embeddings", None)
        self.vocab_size = vocab_size(target_model)
        self.draft_context = draft_context(draft)  # γ fits in it
        self.draft_head = head_rows(draft)  # the ids a trimmed draft head scores (drafts/vocab.py); None: all
        self.draft = draft
        self.exit_adapter = exit_adapter
        self.target_worker = Worker("target")
        self.target = self.target_worker.call(TargetSide, target_model)
        self.loop = LoopThread("mirror-scheduler")
        self.host: Optional[DraftHost] = None
        try:
            self.host = DraftHost(draft) if draft is not None else None
        except BaseException:
            self.close()
            raise
        self.draft_failure: Optional[str] = None
        self.local_build = local_build(draft)  # sd's in-process draft, built on its first generation
        self.local_draft: Optional[Draft] = None
        self.recycled: Optional[Recycled] = None  # the recycled draft's table, for the pipeline's life
        if named == RECYCLE:
            self.recycled_table()

    def recycled_table(self) -> Recycled:
        """The recycled draft's table: made on first need (the recycled draft loaded, or auto's choice of the tree
        beside a model draft that does not pay), then kept for the pipeline's life."""
        if self.recycled is None:
            assert self.vocab_size is not None, "the recycled table keeps a row per token id"
            model = self.target_model
            why = self.target_worker.call(lambda: takes_tree(model, self.target.cache))
            self.recycled = Recycled(self.vocab_size, f"one path: this {family(model)} model takes no "
                                     f"tree ({why})" if why else None)
            if why:
                print(f"mirror-mlx: note: the recycled draft verifies {self.recycled.one_path}", file=sys.stderr)
        return self.recycled

    # --- the doors the layers above use (the server, tune, bench, doctor): never the parts themselves

    def on_target(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) on the target's thread (MLX state and the target's cache live there); its result."""
        return self.target_worker.call(fn, *args)

    def submit_on_target(self, fn: Callable[..., T], *args: object) -> "Future[T]":
        """fn(*args) queued on the target's thread; the future of its result (to time work beside it)."""
        return self.target_worker.submit(fn, *args)

    def with_target(self, fn: Callable[..., T], *args: object) -> T:
        """fn(target_side, *args) on the target's thread: the target's cache through TargetSide's doors."""
        return self.target_worker.call(fn, self.target, *args)

    def replace_target(self, build: Callable[..., TargetSide], *args: object) -> None:
        """Close the target side and go on with build(*args), made on the target's thread (a stage of a
        model split by layers across ranks: distributed/pipeline.py)."""
        self.target_worker.call(self.target.close)
        self.target = self.target_worker.call(build, *args)

    @property
    def proposing(self) -> Proposing:
        """What the pair proposes with: the draft as it is now (across ranks, set after the engine is built)."""
        return Proposing(self.draft is not None, self.named)

    @property
    def has_draft(self) -> bool:
        """A draft model is running (not dropped after a failure, not the lookup alone)."""
        return self.host is not None

    @property
    def draft_host(self) -> Optional[DraftHost]:
        """The draft host this process can time alone (tune, doctor): the engine's; across ranks rank 0's
        own, None on the other ranks (their draft lives beside rank 0)."""
        return getattr(self.host, "local", self.host)

    @property
    def draft_pid(self) -> Optional[int]:
        """The draft host process's pid (None: no draft, or its loop runs on a thread here)."""
        return getattr(self.host, "pid", None)

    @property
    def draft_vocab(self) -> Optional[int]:
        return getattr(self.host, "vocab_size", None)

    @property
    def draft_kind(self) -> Optional[str]:
        return getattr(self.host, "kind", None)

    @property
    def draft_threads(self) -> list[int]:
        """The native ids of the draft host's threads: every thread of its process, or its one thread here."""
        if self.host is None:
            return []
        if self.host.pid:
            return [int(t) for t in os.listdir(f"/proc/{self.host.pid}/task")]
        thread = self.host.thread  # (a host without a process runs its loop on this thread)
        return [thread.native_id] if thread is not None and thread.native_id is not None else []

    @property
    def drafts_locally(self) -> bool:
        """sd drafts in this process, on the target's thread (an MLX draft: `local_build`)."""
        return self.local_build is not None

    def local_window(self, context: list[int], last: int, gamma: int) -> float:
        """Seconds of sd's in-process window after `context` + [last] (its draft synced to context[:-2] first,
        so two new tokens reach it, as in a real step), on the target's thread (tune)."""

        def once() -> float:
            draft = self._local_sync(context[:-2])
            t0 = time.perf_counter()
            draft.rollout(context, [[last]], gamma)
            return time.perf_counter() - t0

        return self.target_worker.call(once)

    def close(self) -> None:
        if self.host is not None:
            self.host.close()
        self.loop.close()
        self.target_worker.call(self.target.close)
        self.local_draft = None
        self.target_worker.close()

    def reset(self) -> None:
        """Forget cached conversation state (both caches)."""
        self.target_worker.call(self._reset_target)
        if self.host is not None and self.draft_failure is None:
            try:
                self.host.reset(timeout=DRAFT_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - a dead or stalled host: dropped, visibly, as in a step
                self._drop_draft(e)

    def _reset_target(self) -> None:
        self.target.reset()
        if self.local_draft is not None:
            self.local_draft.reset()

    def _local(self) -> Draft:
        """sd's in-process draft, built on its first use, on the target's thread."""
        if self.local_draft is None:
            assert self.local_build is not None, "sd drafts in process only where the draft builds here"
            self.local_draft = self.local_build()
        return self.local_draft

    def _local_sync(self, context: list[int]) -> Draft:
        """sd's in-process draft holds `context`; that draft."""
        draft = self._local()
        if hasattr(draft, "sync"):
            draft.sync(context)
        return draft

    def _host(self) -> DraftHost:
        """The draft host a drafting proposer's step posts to (a dropped host hands the proposer over)."""
        assert self.host is not None, "a proposer drafts only while its draft host is up"
        return self.host

    def exit_layer(self, opts: DecodeOptions) -> int:
        """ℓ_e: as asked, else the exit adapter's layer, else N // 2 (the paper's default)."""
        if opts.exit_layer is not None:
            return opts.exit_layer
        return getattr(self.exit_adapter, "exit_layer", None) or default_exit_layer(self.n_layers)

    def generate(self, prompt: Sequence[int], opts: DecodeOptions, prompt_cache: Optional[PromptCache] = None,
                 leave_draft: Optional[Callable[[Step], Optional[str]]] = None) -> Generator[Step, None, None]:
        """Yield a `Step` per step, until max_tokens or a stop token; `prompt` and `opts` are a resolved Plan's.

        `leave_draft(step)`, after each step that leaves more to do: why to go on with the target alone, or None.
        `prompt_cache`: the target continues it in place, as mlx_lm.generate does; when the generation ends it
        holds the prompt and every committed token, as mlx-lm leaves it, and the engine takes a fresh cache.
        """
        if self.target.adopted:  # (a caller's cache is released when its generation ends; never reused)
            self.target_worker.call(self._reset_target)
        gen = self._begin(prompt, opts)
        t0 = time.perf_counter()
        stepping = True  # in a prefill or a step: the target's cache may hold rows that `cached` does not list yet
        if prompt_cache is not None:
            self.target_worker.call(self.target.adopt, prompt_cache.cache, prompt_cache.tokens)
        try:
            # prompt_tokens as mlx-lm counts them: after a prompt cache, those that follow its prefix
            given = len(prompt) - len(prompt_cache.tokens or []) if prompt_cache is not None else len(prompt)
            first = Stats(prompt_tokens=given, prefill_tokens=self._prefill(gen, prompt, given))
            first.prefill_seconds = time.perf_counter() - t0
            mark = time.perf_counter()
            stepping = False
            first += self._first(gen)  # the first step's record carries the prefill
            produced, steps = 0, 0
            while produced < opts.max_tokens:
                stepping = True
                rec = gen.proposer.step(gen, opts.max_tokens - produced)
                if self.draft_failure is not None:  # the draft failed in this step: the target goes on alone
                    gen.proposer = gen.proposer.alone()
                steps += 1
                new, stopped = cut(rec.tokens, opts.max_tokens - produced, opts.stop_tokens)
                held = gen.commit(new)
                produced += len(new)
                stats = gen.stats(rec, len(new), held, self.draft_failure)
                if steps == 1:
                    stats = first + stats
                drafted = len(rec.tokens) - 1  # every step commits accepted draft tokens, then one of the target's
                rows = self.target.logprobs  # (the step's verify set them)
                step = Step(new, [i < drafted for i in range(len(new))], rec.offered, rec.accepted, rec.reused,
                            rec.fallback, stats, None if rows is None else rows[: len(new)])
                if gen.mode != "ar" and leave_draft is not None and produced < opts.max_tokens and not stopped:
                    why = leave_draft(step)
                    if why:  # on text that defeats the draft; it is idle between steps: the target goes on alone
                        gen.alone()
                        gen.left = f"after step {steps}: {why}"
                        stats.left_draft = gen.left
                now = time.perf_counter()
                stats.decode_seconds, step.span, mark = now - mark, (mark, now), now
                stats.peak_memory_gb = mx.get_peak_memory() / 1e9
                stepping = False
                yield step
                if stopped:
                    break
        finally:
            if prompt_cache is not None:  # back to the caller: every committed token, or (cut) the rows known right
                self.target_worker.call(self.target.release, None if stepping else gen.committed)
            elif stepping:  # a prefill or step was cut (an error, a KeyboardInterrupt in a worker): forget the cache
                self.target_worker.call(self._reset_target)

    def _begin(self, prompt: Sequence[int], opts: DecodeOptions) -> Generation:
        """A generation's state: its mode, proposer, sampler (seeded); the target's exit set up."""
        mode = opts.mode if self.draft_failure is None else "ar"
        proposer = self._proposer(prompt, opts)
        if mode == "ar" or self.host is None:  # no draft model runs (dropped, or none)
            proposer = proposer.alone()
        drafts, local = proposer.drafts, mode == "sd" and self.local_build is not None
        host = "" if self.host is None or not drafts else "in-process" if local else \
            "process" if self.host.process else "thread"
        base, processors = samplers(opts)
        if opts.seed is not None:  # MLX's random state is per thread: seed the thread that samples
            self.target_worker.call(mx.random.seed, opts.seed)
        mx.reset_peak_memory()
        if mode == "mirror":
            self.target_worker.call(self.target.set_exit_layer, self.exit_layer(opts),
                                    adapter_for(self.exit_adapter, self.exit_layer(opts)))
        exit_layer = self.exit_layer(opts) if opts.mode == "mirror" else None
        return Generation(opts, list(prompt), mode, mode, host, exit_layer, proposer, row_sampler(base, opts.seed),
                          processors, draft_vocab=self.draft_head if drafts else None)

    def _proposer(self, prompt: Sequence[int], opts: DecodeOptions) -> Proposer:
        """The proposer the plan names (Proposing.kind), with its own state for this generation."""
        kind = opts.proposer or self.proposing.kind(opts.mode, opts.lookup)
        index = None
        if opts.lookup:
            assert opts.ngram_min is not None, "a checked plan's shortest n-gram is set (validate.request)"
            index = Lookup(prompt, opts.ngram_max, opts.ngram_min, opts.row_cost)
        if kind == "mirror":  # which branches each step rolls out (calibrated as it goes; with no B, those that
            # pay, by this generation's own timings: one process only, since every rank must post the same ones)
            return Mirror(self, index, BranchBudget(opts.branches, fit=isinstance(self.host, DraftHost)))
        if kind == RECYCLE:
            return RecycledTree(self, index, self.recycled_table())
        return PROPOSERS[kind](self, index)

    def _prefill(self, gen: Generation, prompt: Sequence[int], given: int) -> int:
        """The target prefills the prompt, the draft beside it (or, in-process, after it); a draft that cannot
        even prefill is dropped (the target goes on alone, visibly). Returns the tokens the target ran."""
        opts, failed = gen.opts, list[BaseException]()
        host = self.host if gen.proposer.drafts else None  # (a proposer that drafts has its host: `_begin`)
        local = gen.mode == "sd" and self.local_build is not None
        if host is not None and not local:  # the draft prefills beside the target
            _post_or_note(host.post_sync, prompt[:-1], failed=failed)
        ran = self.target_worker.call(self.target.hold, prompt[:-1], opts.prefill_step_size,  # the last is pending
                                      prefill_progress(opts.prompt_progress_callback, given), gen.proposer.top_rows())
        gen.proposer.prefilled(self.target.seen, partial(self.target_worker.call, self.target.time_widths),
                               opts.row_cost)
        if host is not None:
            try:
                if failed:
                    raise failed[0]
                if local:  # after the target, on its thread
                    self.target_worker.call(self._local_sync, prompt[:-1])
                else:
                    host.wait_done(opts.draft_timeout)
            except Exception as e:
                self._drop_draft(e)
                gen.alone()
                gen.ran = "ar"
        return ran

    def _first(self, gen: Generation) -> Stats:
        """Before the first step: what the proposer spent (mirror's first window); a draft that fails there leaves
        the target alone."""
        rec = gen.proposer.first(gen)
        if self.draft_failure is not None and gen.proposer.drafts:
            gen.alone()
            gen.ran = "ar"
        return Stats(**rec.counts())

    # --- what the proposers call: the target's forwards, the draft's windows; each returns a StepRecord -------

    def verify(self, gen: Generating, window: list[int], rec: StepRecord) -> StepRecord:
        """The target verifies `window` (ar: none) in one forward."""
        s0 = time.perf_counter()
        ys, a = self.target_worker.call(self.target.verify, gen.committed, window, gen.sampler, gen.processors)
        return rec.verified(window, ys, a, time.perf_counter() - s0)

    def verify_tree(self, gen: Generating, tree: Tree, top: int) -> tuple[Walk, np.ndarray, float]:
        """The target verifies `tree` in one forward: (what it committed, each node's top ids, its seconds)."""
        s0 = time.perf_counter()
        out, ids = self.target_worker.call(self.target.verify_tree, gen.committed, tree, gen.sampler,
                                           gen.processors, top)
        return out, ids, time.perf_counter() - s0

    def sd_step(self, gen: Generating) -> StepRecord:
        """sd: the draft's window, then the target verifies it (serial); a draft that fails leaves the target alone."""
        rec = StepRecord()
        if self.local_build is not None:
            failed = self.target_worker.call(self._local_sd, gen, rec)
            if failed is None:
                return rec
            self._drop_draft(failed)
            return self.verify(gen, [], rec)
        return self.verify(gen, self.rollout(gen, rec) or [], rec)

    def _local_sd(self, gen: Generation, rec: StepRecord) -> Optional[BaseException]:
        """sd's step on the target's thread (one hop): the in-process draft's window, then the target verifies it,
        into `rec`. Returns the draft's error (the caller drops the draft) or None."""
        committed, r0 = gen.committed, time.perf_counter()
        try:
            out = self._local().rollout(committed[:-1], [[committed[-1]]], gen.gamma)
        except Exception as e:  # noqa: BLE001 - the caller drops the draft, visibly
            return e
        r1 = time.perf_counter()
        rec.drew(out, r0, r1)
        ys, a = self.target.verify(committed, out.windows[0], gen.sampler, gen.processors)
        rec.verified(out.windows[0], ys, a, time.perf_counter() - r1)
        return None

    def mirror_step(self, gen: Generating, m: Mirror, window: list[int], from_lookup: bool, budget: int,
                    rec: StepRecord) -> StepRecord:
        """One Mirror-SD step of `m`'s (its branch budget; with its lookup, no serial window after a fallback)."""
        return self.loop.run(self._mirror_step(gen, m.plan, m.index is not None, window, from_lookup, budget, rec))

    def rollout(self, gen: Generating, rec: StepRecord) -> Optional[list[int]]:
        """One fresh window after what `gen` committed (`_rollout`), from the caller's thread."""
        return self.loop.run(self._rollout(gen, gen.committed, rec))

    async def _mirror_step(self, gen: Generating, plan: BranchBudget, lookup: bool, window: list[int],
                           from_lookup: bool, budget: int, rec: StepRecord) -> StepRecord:
        """One Mirror-SD step; `budget` tokens are still wanted. A next window matters only if two more tokens
        are wanted after the step (the first is the target's own), so no branches when budget < 3 and no
        fallback after it; with the `lookup` on, a fallback leaves the next window to the proposer (Mirror)."""
        opts, committed, gamma, host = gen.opts, gen.committed, len(window), self._host()
        exclude = window + [-1]  # row r < γ never proposes ŷ_{r+1}; the bonus row keeps plain top-κ
        failed: list[BaseException] = []
        branches = budget > 2  # the step commits at least one token
        post = partial(_post_or_note, partial(_post_budgeted, host, plan), list(committed), window,
                       failed=failed) if branches else (lambda *_: None)
        if branches:  # the draft feeds the window during the prefix: the rollout then feeds one token per branch
            _post_or_note(host.post_prepare, committed + window, failed=failed)
        cand, p0, p1 = await self.target_worker.run(self.target.prefix, [committed[-1]] + window, opts.kappa,
                                                    exclude, post)
        try:
            (ys, a, omega), s0, s1 = await self.target_worker.run(self.target.suffix, committed, window, gen.sampler,
                                                                  gen.processors)
        except BaseException:  # a user's sampler or logits processor raised: to the caller, the draft kept in step
            if branches and not failed:
                await self._drain_branches(opts, gamma)
            raise
        new = window[:a] + [ys[a]]
        windows, r0, r1, arrived = None, s1, s1, s1
        if branches:
            try:  # the host rolled out every branch meanwhile
                if failed:
                    raise failed[0]
                left = max(0.0, opts.draft_timeout - (time.perf_counter() - s1))
                out, r0, r1 = await asyncio.wait_for(host.windows(gamma), left)
            except Exception as e:  # the draft raised, stalled or died: finish with the target alone, visibly
                self._drop_draft(e)
                rec.tokens = new
                return rec
            arrived = time.perf_counter()
            windows = spread(cand, plan.picked, out.windows)
            rec.branches_rolled = plan.rolled_out(cand)
            plan.cost.saw_step(rec.branches_rolled, r1 - r0, s1 - s0)
            rec.drew(out, r0, r1)
            rec.hidden_draft_seconds = overlap(r0, r1, s0, s1)
        rec.verified(window, ys, a, s1 - s0)
        rec.prefix_seconds, rec.omega_sum, rec.from_lookup = p1 - p0, omega, from_lookup
        plan.settle(a)
        # the engine's clocks (the host's rollout on the same clock): what a step spent where (bench/summary.py)
        rec.timeline = {"prefix": (p0, p1), "suffix": (s0, s1), "rollout": (r0, r1), "accepted": a, "arrived": arrived}
        reused = reuse_window(cand, windows, a, new[-1]) if windows is not None else None
        if new[-1] in cand[a] and (windows is None or reused is not None):
            # c ∈ C_A (and rolled out, under a budget): the next window is w(A, c)
            rec.reused, rec.window = True, reused
            return rec
        rec.fallback = True
        if budget - len(new) < 2 or any(t in opts.stop_tokens for t in new) or lookup:
            return rec  # no window after this step could be used, or the lookup's comes first (Mirror._window)
        f0, before = time.perf_counter(), rec.draft_seconds
        rec.window = await self._rollout(gen, committed + new, rec)  # the target waits
        rec.timeline["serial"] = (f0, time.perf_counter(), rec.draft_seconds - before)
        plan.cost.saw_window(rec.draft_seconds - before)
        return rec

    async def _drain_branches(self, opts: DecodeOptions, gamma: int) -> None:
        """Take the reply to branches posted in a step that failed, so the host's next answer is the next step's."""
        try:
            await asyncio.wait_for(self._host().windows(gamma), opts.draft_timeout)
        except Exception as e:  # noqa: BLE001 - the draft failed too: dropped, visibly, as in a step
            self._drop_draft(e)

    async def _rollout(self, gen: Generating, committed: list[int], rec: StepRecord) -> Optional[list[int]]:
        """One fresh window after `committed`, on the critical path, counted in `rec`; None if the draft failed."""
        try:
            host, gamma = self._host(), gen.gamma
            host.post_rollout(committed[:-1], [[committed[-1]]], gamma)
            out, r0, r1 = await asyncio.wait_for(host.windows(gamma), gen.opts.draft_timeout)
        except Exception as e:
            self._drop_draft(e)
            return None
        rec.drew(out, r0, r1)
        return out.windows[0]

    def _drop_draft(self, error: BaseException) -> None:
        reason = "timed out" if isinstance(error, (asyncio.TimeoutError, TimeoutError)) else repr(error)
        self.draft_failure = f"draft {reason}; continuing with the target alone (ar)"
        print(f"mirror-mlx: warning: {self.draft_failure}", file=sys.stderr)
        if self.host is not None:  # a stalled or dead host gets no grace: no orphan, no shared memory left
            self.host.kill()
            self.host = None
