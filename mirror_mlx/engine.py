"""The Mirror-SD generation loop (docs/design.md §3-4), one code path for `mirror`, `sd` and `ar`.

State between steps: `committed` holds every committed token; the target's cache holds all of
them but the last (the *pending* token); `window` holds the γ draft tokens proposed after it.

mirror step:  target prefix over [pending, ŷ1..ŷγ] → early-exit top-κ sets on the ring
              → (target suffix ‖ the draft host rolls out every branch, or the top B: branch_budget.py)
              → verify → reuse or fallback.
sd step:      draft rolls out one window, then the target verifies it (serial).
lookup step:  (sd with lookup) the context's continuation (mirror_mlx/lookup.py) is the window, at no draft
              cost; where it offers none the step is sd's (beside a model draft) or ar's (the lookup alone).
              (mirror with lookup) where no branch was reused, the lookup's window, if any, replaces the
              draft's serial rollout on the critical path.
ar step:      the target alone, one token per forward.
Every committed token is the target's own choice (argmax, or a sample of its processed
distribution) given the committed prefix, so every mode returns what the target alone would.

The draft lives behind a DraftHost (mirror_mlx/drafts/host.py): the scheduler posts requests on the ring
and awaits the windows; it never calls the draft. One exception: sd with an MLX draft (plain or SS)
drafts in this process, on the target's own thread (a copy of the draft built there): a serial window
hides nothing, so the ring's round trip per window would only add to it. The scheduler is one
asyncio loop on its own thread, so the synchronous API also works from inside a running event loop.
"""

import asyncio
import json
import sys
import time
from functools import partial
from pathlib import Path
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar, Union

import mlx.core as mx
import mlx.nn as nn

from .drafts.host import DraftHost

from .drafts.recipes import DraftRecipe, mlx_draft, ss_draft
from .branch_budget import BranchBudget, ExitView, spread, stems as branch_stems
from .drafts.mlx_draft import MLXDraft
from .draft_api import Draft
from .exit_adapter import adapter_for
from .lookup import Lookup
from .options import DRAFT_TIMEOUT_S, DecodeOptions, default_exit_layer
from .prompt_cache import PromptCache
from .sampling import row_sampler, samplers
from .stats import Stats, Step
from .model_parts import text_model, vocab_size
from .target import TargetSide
from .workers import LoopThread, Worker


T = TypeVar("T")
FRESH = object()  # mirror's next window is a fresh one (no branch reused): the lookup's, else the draft's rollout


def reuse_window(cand: list[list[int]], windows: list[list[list[int]]], a: int, c: int) -> Optional[list[int]]:
    """The precomputed window w(A, c) if the correction c was among row A's candidates (and its branch was
    rolled out, under a branch budget), else None."""
    if c in cand[a]:
        return windows[a][cand[a].index(c)]
    return None


def note_window(stats: Stats, offered: int, accepted: int) -> None:
    """Count one verified window: `accepted` of its `offered` draft tokens, and a rejection unless all."""
    stats.proposed += offered
    stats.accepted += accepted
    stats.rejections += accepted < offered


def note_lookup(stats: Stats, offered: int, accepted: int) -> None:
    """Count that the verified window was the lookup's (its share of note_window's counts)."""
    stats.lookup_windows += 1
    stats.lookup_proposed += offered
    stats.lookup_accepted += accepted
    stats.lookup_rejections += accepted < offered


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def _post_or_note(post: Callable, *args: Any, failed: list) -> None:
    """Post on the target worker; a failure is noted for the scheduler (which drops the draft), not raised there."""
    try:
        post(*args)
    except Exception as e:  # noqa: BLE001
        failed.append(e)


def _no_post(cand: list[list[int]], view: Optional[ExitView] = None) -> None:
    """A step that needs no branch rollout posts nothing."""


def _post_budgeted(host: Any, plan: BranchBudget, context: list[int], window: list[int], cand: list[list[int]],
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
        config = Path(str(draft.args[0])) / "config.json"
        if config.is_file():
            try:
                return json.loads(config.read_text()).get("max_position_embeddings")
            except (OSError, ValueError):
                return None
    return None


def prefill_progress(callback: Optional[Callable[[int, int], None]], given: int):
    """mlx-lm's prompt_progress_callback(done, total) over the `given` prompt tokens, from the prefill's chunks
    of the new ones (the rest came from a cache; the last is the pending token, done with the first step)."""
    if callback is None:
        return None
    return lambda done, new: callback(max(0, given - 1 - new + done), given)


def local_build(draft: Union[Draft, DraftRecipe, None]) -> Optional[Callable[[], Draft]]:
    """How sd builds its in-process copy of the draft (on the target's thread), or None where sd keeps the
    host: MLX drafts only (a plain mlx-lm model or an SS draft; a Core ML package runs in its host), and of
    a draft object only a plain MLXDraft (a copy with its own cache over the same weights)."""
    if isinstance(draft, DraftRecipe):
        return partial(draft.build, *draft.args) if draft.build in (mlx_draft, ss_draft) else None
    if type(draft) is MLXDraft:
        return partial(MLXDraft, draft.model, draft.prefill_step_size)
    return None


class Engine:
    """Owns the target worker, the draft host and the scheduler's loop; `generate` yields tokens.

    `draft`: a DraftRecipe (the host process builds it: the default, see mirror_mlx/drafts/host.py), or a
    draft object built in this process (its host loop runs on a thread).
    """

    def __init__(self, target_model: nn.Module, draft: Union[Draft, DraftRecipe, None] = None,
                 exit_adapter: Optional[Callable] = None, lookup_only: bool = False):
        self.target_model = target_model
        self.lookup_only = lookup_only  # the draft is the prompt lookup alone (draft_model="lookup"): no model
        self.n_layers = len(text_model(target_model).layers)
        self.context_length = getattr(getattr(text_model(target_model), "args", None), "max_position_embeddings", None)
        self.vocab_size = vocab_size(target_model)
        self.draft_context = draft_context(draft)  # γ fits in it
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

    # --- the doors the layers above use (the server, tune, bench, doctor): never the parts themselves

    def on_target(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the target's thread (MLX state and the target's cache live there); its result."""
        return self.target_worker.call(fn, *args)

    def submit_on_target(self, fn: Callable[..., T], *args: Any) -> "Future[T]":
        """fn(*args) queued on the target's thread; the future of its result (to time work beside it)."""
        return self.target_worker.submit(fn, *args)

    def with_target(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(target_side, *args) on the target's thread: the target's cache through TargetSide's doors."""
        return self.target_worker.call(fn, self.target, *args)

    def replace_target(self, build: Callable[..., TargetSide], *args: Any) -> None:
        """Close the target side and go on with build(*args), made on the target's thread (a stage of a
        model split by layers across ranks: distributed/pipeline.py)."""
        self.target_worker.call(self.target.close)
        self.target = self.target_worker.call(build, *args)

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
        import os

        if self.host is None:
            return []
        if self.host.pid:
            return [int(t) for t in os.listdir(f"/proc/{self.host.pid}/task")]
        return [self.host.thread.native_id]

    @property
    def drafts_locally(self) -> bool:
        """sd drafts in this process, on the target's thread (an MLX draft: `local_build`)."""
        return self.local_build is not None

    def local_window(self, context: list[int], last: int, gamma: int) -> float:
        """Seconds of sd's in-process window after `context` + [last] (its draft synced to context[:-2] first,
        so two new tokens reach it, as in a real step), on the target's thread (tune)."""

        def once() -> float:
            self._local_sync(context[:-2])
            t0 = time.perf_counter()
            self.local_draft.rollout(context, [[last]], gamma)
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
                self._drop_draft(e, Stats())

    def _reset_target(self) -> None:
        self.target.reset()
        if self.local_draft is not None:
            self.local_draft.reset()

    def _local_sync(self, context: list[int]) -> None:
        """sd's in-process draft (built on the first call, on the target's thread) holds `context`."""
        if self.local_draft is None:
            self.local_draft = self.local_build()
        if hasattr(self.local_draft, "sync"):
            self.local_draft.sync(context)

    def _local_sd(self, committed: list[int], gamma: int, sampler, processors) -> tuple:
        """sd's step on the target's thread: the in-process draft's window, then the target verifies it.
        Returns (the draft's error or None, Rollout, r0, r1, ys, a, s1)."""
        r0 = time.perf_counter()
        try:
            out = self.local_draft.rollout(committed[:-1], [[committed[-1]]], gamma)
        except Exception as e:  # noqa: BLE001 - the scheduler drops the draft, visibly
            return e, None, r0, r0, None, 0, r0
        r1 = time.perf_counter()
        ys, a = self.target.verify(committed, out.windows[0], sampler, processors)
        return None, out, r0, r1, ys, a, time.perf_counter()

    def exit_layer(self, opts: DecodeOptions) -> int:
        """ℓ_e: as asked, else the exit adapter's layer, else N // 2 (the paper's default)."""
        if opts.exit_layer is not None:
            return opts.exit_layer
        return getattr(self.exit_adapter, "exit_layer", None) or default_exit_layer(self.n_layers)

    def generate(self, prompt: Sequence[int], opts: DecodeOptions, prompt_cache: Optional[PromptCache] = None,
                 leave_draft: Optional[Callable[[Step], Optional[str]]] = None) -> Iterator[Step]:
        """Yield a `Step` per step, until max_tokens or a stop token. `prompt` and `opts` are a resolved Plan's
        (checked once by validate.request, before any work starts).

        `leave_draft(step)`, after each step that leaves more to do: why to go on with the target alone, or
        None (mode auto's test of the text at hand; the draft is idle between steps).
        `prompt_cache`: the target continues this cache, extended in place, as mlx_lm.generate with a
        prompt_cache; `prompt` is `prompt_cache.prompt(ids)` (see validate.request). When the generation ends (or
        is closed) the cache holds the prompt and every committed token, the last (or the
        end-of-sequence token) included, as mlx-lm leaves it, and the engine goes on with a cache of its own.
        """
        if self.target.adopted:  # (a caller's cache is released when its generation ends; never reused)
            self.target_worker.call(self._reset_target)
        mode = opts.mode if self.draft_failure is None else "ar"
        # prompt_tokens as mlx-lm counts them: after a prompt cache, those that follow its prefix
        given = len(prompt) - len(prompt_cache.tokens or []) if prompt_cache is not None else len(prompt)
        exit_layer = self.exit_layer(opts) if opts.mode == "mirror" else None
        local = mode == "sd" and self.local_build is not None
        drafts = mode != "ar" and self.host is not None  # a model draft runs (sd with the lookup alone: none)
        host = "" if not drafts else "in-process" if local else "process" if self.host.process else "thread"
        index = Lookup(prompt, opts.ngram_max, opts.ngram_min, opts.row_cost) if opts.lookup else None
        ran, left = mode, ""  # what Stats calls the mode (ar only if the draft never ran), why it was left

        def record() -> Stats:
            """A fresh record for the next step's facts, with what describes the generation as it stands."""
            return Stats(mode=ran, chosen_mode=opts.mode, kappa=opts.kappa, gamma=opts.gamma, exit_layer=exit_layer,
                         why=opts.why, draft_host=host, draft_failure=self.draft_failure, left_draft=left,
                         placement=opts.placement, branches=opts.branches, lookup=index is not None)

        base, processors = samplers(opts)
        sampler = row_sampler(base, opts.seed)
        if opts.seed is not None:  # MLX's random state is per thread: seed the thread that samples
            self.target_worker.call(mx.random.seed, opts.seed)
        mx.reset_peak_memory()
        if mode == "mirror":
            self.target_worker.call(self.target.set_exit_layer, self.exit_layer(opts),
                                    adapter_for(self.exit_adapter, self.exit_layer(opts)))
        # which branches each mirror step rolls out (calibrated as it goes; with no B, those that pay, by this
        # generation's own timings: one process only, since every rank must post the same branches)
        plan = BranchBudget(opts.branches, fit=isinstance(self.host, DraftHost))
        t0 = mark = time.perf_counter()
        stats = record()  # the first step's record carries the prefill
        stats.prompt_tokens = given
        failed: list[BaseException] = []
        committed, produced, steps, held = list(prompt), 0, 0, 0
        run = self.loop.run
        # in a prefill or a step: the target's cache may hold rows that `cached` does not list yet
        stepping = True
        if prompt_cache is not None:
            self.target_worker.call(self.target.adopt, prompt_cache.cache, prompt_cache.tokens)
        try:
            if drafts and not local:  # the draft prefills beside the target
                _post_or_note(self.host.post_sync, prompt[:-1], failed=failed)
            stats.prefill_tokens = self.target_worker.call(self.target.start, prompt, opts.prefill_step_size,
                                                           prefill_progress(opts.prompt_progress_callback, given))
            if drafts:
                try:
                    if failed:
                        raise failed[0]
                    if local:  # after the target, on its thread
                        self.target_worker.call(self._local_sync, prompt[:-1])
                    else:
                        self.host.wait_done(opts.draft_timeout)
                except Exception as e:  # the draft cannot even prefill: the target alone, visibly
                    self._drop_draft(e, stats)
                    mode = ran = stats.mode = "ar"
            stats.prefill_seconds = time.perf_counter() - t0
            mark = time.perf_counter()
            stepping = False
            window = None
            if mode == "mirror":  # (one token wanted: the target's own at the pending row, no window needed)
                window = FRESH if opts.max_tokens > 1 else []
                if window is FRESH and not (index is not None and index.propose(1)):  # the lookup has none
                    window = run(self._timed_rollout(committed, opts, stats))
                    if window is None:
                        mode = ran = stats.mode = "ar"
            while produced < opts.max_tokens:
                stepping = True
                budget = opts.max_tokens - produced
                mirror = mode == "mirror" and self.draft_failure is None
                lookup = index.propose(min(opts.gamma, budget - 1)) \
                    if index is not None and budget > 1 and not mirror else []
                if mirror:  # (a failed rollout drops the draft: then the step is ar's)
                    window, from_lookup = self._mirror_window(window, committed, index, opts, stats, budget)
                if lookup:  # the context offers a continuation: it is the window, no draft runs
                    new = self._lookup_step(committed, lookup, sampler, processors, stats)
                elif mirror and self.draft_failure is None:
                    new, window = run(self._mirror_step(committed, window, opts, sampler, processors, stats, budget,
                                                        plan, index is not None, from_lookup))
                elif mode == "sd" and drafts and self.draft_failure is None and budget > 1:  # (the last: see ar)
                    new = run(self._sd_step(committed, opts, sampler, processors, stats))
                else:  # ar, or sd's last token: it is the target's own at the pending row, a window cannot help
                    s0 = time.perf_counter()
                    ys, _ = self.target_worker.call(self.target.verify, committed, [], sampler, processors)
                    stats.suffix_seconds += time.perf_counter() - s0
                    new = ys[:1]
                stats.target_forwards = stats.steps = 1
                steps += 1
                drafted = len(new) - 1  # every step commits accepted draft tokens, then one of the target's
                new = new[: opts.max_tokens - produced]
                stop = next((i for i, t in enumerate(new) if t in opts.stop_tokens), None)
                if stop is not None:
                    new = new[: stop + 1]
                committed += new
                if index is not None:
                    index.extend(new)
                    stats.lookup_held, held = index.held - held, index.held
                produced += len(new)
                stats.generation_tokens = len(new)
                step = Step(new, [i < drafted for i in range(len(new))], stats.proposed, stats.accepted,
                            stats.reuses > 0, stats.fallbacks > 0, stats, self.target.logprobs[: len(new)])
                if mode != "ar" and leave_draft is not None and produced < opts.max_tokens and stop is None:
                    why = leave_draft(step)
                    if why:  # on text that defeats the draft; it is idle between steps: the target goes on alone
                        mode, left = "ar", f"after step {steps}: {why}"
                        stats.left_draft = left
                now = time.perf_counter()
                stats.decode_seconds, mark = now - mark, now
                stats.peak_memory_gb = mx.get_peak_memory() / 1e9
                stepping = False
                yield step
                if stop is not None:
                    break
                stats = record()
        finally:
            if prompt_cache is not None:  # back to the caller: every committed token, or (cut) the rows known right
                self.target_worker.call(self.target.release, None if stepping else committed)
            elif stepping:  # a prefill or step was cut (an error, a KeyboardInterrupt in a worker): forget the cache
                self.target_worker.call(self._reset_target)

    # --- steps -------------------------------------------------------------------------------------

    def _mirror_window(self, window, committed, index, opts, stats, budget) -> tuple[Optional[list[int]], bool]:
        """The window of mirror's next step, and whether the lookup proposed it: with one token wanted none
        (the pending row's token is committed whatever it proposes); after a step that reused no branch
        (FRESH), the lookup's, else the draft's rollout on the critical path (None if the draft failed)."""
        if budget == 1:
            return [], False
        if window is not FRESH:
            return window, False
        proposal = index.propose(min(opts.gamma, budget - 1)) if index is not None else []
        if proposal:
            return proposal, True
        return self.loop.run(self._timed_rollout(committed, opts, stats)), False

    async def _mirror_step(self, committed, window, opts, sampler, processors, stats, budget,
                           plan: Optional[BranchBudget] = None, lookup=False, from_lookup=False):
        """One step; `budget` tokens are still wanted. A window after the step can change the output only if
        two more tokens are wanted then (the first is the target's own at the pending row, whatever the window
        proposes), so the draft is asked for no other: no branches when budget < 3, no fallback after it.
        `plan`: the branch budget (branch_budget.py), which of the branches the host rolls out. With `lookup` a
        fallback leaves the next window to `_mirror_window` (FRESH); `from_lookup`: this step's window is the
        lookup's."""
        plan = plan or BranchBudget(None)
        kappa, gamma = opts.kappa, len(window)
        rows = [committed[-1]] + window
        # row r < γ never proposes ŷ_{r+1}; the bonus row keeps plain top-κ
        exclude = window + [-1] if opts.exclude_drafted else None
        failed: list[BaseException] = []
        branches = budget > 2  # the step commits at least one token
        post = partial(_post_or_note, partial(_post_budgeted, self.host, plan), list(committed), window,
                       failed=failed) if branches else _no_post
        if branches:  # the draft feeds the window during the prefix: the rollout then feeds one token per branch
            _post_or_note(self.host.post_prepare, committed + window, failed=failed)
        cand, p0, p1 = await self.target_worker.run(self.target.prefix, rows, kappa, exclude, post)
        try:
            (ys, a, omega), s0, s1 = await self.target_worker.run(self.target.suffix, committed, window, sampler,
                                                                  processors)
        except BaseException:  # a user's sampler or logits processor raised: to the caller, the draft kept in step
            if branches and not failed:
                await self._drain_branches(opts, gamma)
            raise
        new = window[:a] + [ys[a]]
        windows, r0, r1 = None, s1, s1
        if branches:
            try:  # the host rolled out every branch meanwhile
                if failed:
                    raise failed[0]
                out, r0, r1 = await asyncio.wait_for(self.host.windows(gamma), self._time_left(opts, s1))
            except Exception as e:  # the draft raised, stalled or died: finish with the target alone, visibly
                self._drop_draft(e, stats)
                return new, None
            arrived = time.perf_counter()
            windows = spread(cand, plan.picked, out.windows)
            stats.branches_rolled += plan.rolled_out(cand)
            plan.cost.saw_step(plan.rolled_out(cand), r1 - r0, s1 - s0)
            stats.draft_seconds += r1 - r0
            stats.hidden_draft_seconds += overlap(r0, r1, s0, s1)
            stats.draft_forwards += out.forwards
            stats.draft_tokens += out.tokens
            stats.rollouts += 1
        stats.prefix_seconds += p1 - p0
        stats.suffix_seconds += s1 - s0
        stats.omega_sum += omega
        note_window(stats, gamma, a)
        plan.settle(a)
        if from_lookup:
            note_lookup(stats, gamma, a)
        # the engine's clocks (the host's rollout on the same clock): what a step spent where (bench/summary.py)
        stats.timeline.append({"prefix": (p0, p1), "suffix": (s0, s1), "rollout": (r0, r1), "accepted": a,
                               "arrived": arrived if branches else s1})
        if new[-1] in cand[a] and (windows is None or reuse_window(cand, windows, a, new[-1]) is not None):
            stats.reuses += 1  # c ∈ C_A (and rolled out, under a budget): the next window is w(A, c)
            return new, reuse_window(cand, windows, a, new[-1]) if windows is not None else None
        stats.fallbacks += 1
        if budget - len(new) < 2 or any(t in opts.stop_tokens for t in new):
            return new, None  # no window after this step could be used
        if lookup:
            return new, FRESH  # the lookup's window if it has one, else the draft's (`_mirror_window`)
        f0, host = time.perf_counter(), stats.draft_seconds
        window = await self._timed_rollout(committed + new, opts, stats)  # the target waits
        stats.timeline[-1]["serial"] = (f0, time.perf_counter(), stats.draft_seconds - host)
        plan.cost.saw_window(stats.draft_seconds - host)
        return new, window

    async def _drain_branches(self, opts: DecodeOptions, gamma: int) -> None:
        """Take the reply to branches posted in a step that failed, so the host's next answer is the next step's."""
        try:
            await asyncio.wait_for(self.host.windows(gamma), opts.draft_timeout)
        except Exception as e:  # noqa: BLE001 - the draft failed too: dropped, visibly, as in a step
            self._drop_draft(e, Stats())

    def _time_left(self, opts: DecodeOptions, since: float) -> float:
        return max(0.0, opts.draft_timeout - (time.perf_counter() - since))

    def _lookup_step(self, committed, window, sampler, processors, stats) -> list[int]:
        """The target verifies the lookup's window (mirror_mlx/lookup.py): sd's verify, no draft time."""
        s0 = time.perf_counter()
        ys, a = self.target_worker.call(self.target.verify, committed, window, sampler, processors)
        stats.suffix_seconds += time.perf_counter() - s0
        note_window(stats, len(window), a)
        note_lookup(stats, len(window), a)
        return window[:a] + [ys[a]]

    async def _sd_step(self, committed, opts, sampler, processors, stats):
        if self.local_build is not None:
            (failed, out, r0, r1, ys, a, s1), _, _ = await self.target_worker.run(
                self._local_sd, committed, opts.gamma, sampler, processors)
            if failed is not None:
                self._drop_draft(failed, stats)
                (ys, _), _, _ = await self.target_worker.run(self.target.verify, committed, [], sampler, processors)
                return ys[:1]
            stats.draft_seconds += r1 - r0
            stats.draft_forwards += out.forwards
            stats.draft_tokens += out.tokens
            stats.rollouts += 1
            stats.suffix_seconds += s1 - r1
            note_window(stats, len(out.windows[0]), a)
            return out.windows[0][:a] + [ys[a]]
        window = await self._timed_rollout(committed, opts, stats)
        if window is None:
            (ys, _), _, _ = await self.target_worker.run(self.target.verify, committed, [], sampler, processors)
            return ys[:1]
        (ys, a), s0, s1 = await self.target_worker.run(self.target.verify, committed, window, sampler, processors)
        stats.suffix_seconds += s1 - s0
        note_window(stats, len(window), a)
        return window[:a] + [ys[a]]

    async def _timed_rollout(self, committed, opts, stats) -> Optional[list[int]]:
        """One fresh window after `committed`, on the critical path; None if the draft failed."""
        try:
            self.host.post_rollout(committed[:-1], [[committed[-1]]], opts.gamma)
            out, r0, r1 = await asyncio.wait_for(self.host.windows(opts.gamma), opts.draft_timeout)
        except Exception as e:
            self._drop_draft(e, stats)
            return None
        stats.draft_seconds += r1 - r0
        stats.draft_forwards += out.forwards
        stats.draft_tokens += out.tokens
        stats.rollouts += 1
        return out.windows[0]

    def _drop_draft(self, error: BaseException, stats: Stats) -> None:
        reason = "timed out" if isinstance(error, (asyncio.TimeoutError, TimeoutError)) else repr(error)
        self.draft_failure = stats.draft_failure = f"draft {reason}; continuing with the target alone (ar)"
        print(f"mirror-mlx: warning: {self.draft_failure}", file=sys.stderr)
        if self.host is not None:  # a stalled or dead host gets no grace: no orphan, no shared memory left
            self.host.kill()
            self.host = None
