"""What proposes the tokens the target verifies, one kind per call: the target alone, the prompt lookup, the
recycled tree, the model draft in sd, or the mirror step. `Proposing.kind` (proposing.py) names it (the
pipeline writes the name into the options); the engine builds that proposer when the generation begins and
calls its `step` each step. Each proposer owns its state for the generation (the lookup's index, the recycled
table, mirror's next window and branch budget); the target's forwards and the draft's rollouts stay the
engine's (engine/loop.py), reached through `Forwards`.
"""

from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

import mlx.core as mx
import numpy as np

from ..drafts.api import Rollout
from ..engine.branch_budget import BranchBudget
from ..engine.tree import Tree, Walk
from ..options import DecodeOptions
from .lookup import LOOKUP, Lookup
from .recycle import DEPTH, K, RECYCLE, WIDTHS, Recycled


@dataclass
class StepRecord:
    """What one step committed and what it spent where: steps never touch Stats; the loop makes each step's
    Stats from its record (`counts`)."""

    tokens: list[int] = field(default_factory=list)  # the accepted window tokens, then the target's own
    offered: int = 0  # window tokens the target verified
    accepted: int = 0  # of them, accepted
    from_lookup: bool = False  # the verified window was the prompt lookup's
    lookup_offered: Optional[int] = None  # a tree's: of `offered`, the lookup's nodes (a window: all or none)
    lookup_accepted: int = 0  # a tree's: of `accepted`, the lookup's
    reused: bool = False  # mirror: the next window is a branch already rolled out
    fallback: bool = False  # mirror: it is not (a serial rollout, the lookup's, or none)
    prefix_seconds: float = 0.0
    suffix_seconds: float = 0.0  # target suffix (mirror) or whole verify forward (sd, lookup, ar)
    draft_seconds: float = 0.0  # every rollout of the step: branches, a serial window
    hidden_draft_seconds: float = 0.0  # of it, what overlapped the target's suffix
    draft_forwards: int = 0
    draft_tokens: int = 0
    rollouts: int = 0
    branches_rolled: int = 0
    omega_sum: float = 0.0  # target mass inside the posted C_A at the correction row
    # mirror: what the step spent where on the engine's clocks (bench/summary.py): prefix, suffix, rollout,
    # accepted, arrived, and serial for a fallback's serial window
    timeline: Optional[dict] = None
    window: Optional[list[int]] = None  # mirror: the next step's window; None: not known yet

    def drew(self, out: Rollout, r0: float, r1: float) -> None:
        """Count one draft rollout that ran from r0 to r1."""
        self.draft_seconds += r1 - r0
        self.draft_forwards += out.forwards
        self.draft_tokens += out.tokens
        self.rollouts += 1

    def verified(self, window: list[int], ys: list[int], a: int, seconds: float) -> "StepRecord":
        """The target verified `window` in `seconds`: `a` tokens accepted, then its own ys[a]."""
        self.tokens, self.offered, self.accepted = window[:a] + [ys[a]], len(window), a
        self.suffix_seconds += seconds
        return self

    def counts(self) -> dict:
        """This step's counts and seconds, as Stats fields."""
        rejected, lookup = int(self.accepted < self.offered), int(self.from_lookup)
        tree = self.lookup_offered is not None
        return dict(proposed=self.offered, accepted=self.accepted, rejections=rejected, lookup_windows=lookup,
                    lookup_proposed=self.lookup_offered if tree else self.offered * lookup,
                    lookup_accepted=self.lookup_accepted if tree else self.accepted * lookup,
                    lookup_rejections=rejected * lookup, reuses=int(self.reused), fallbacks=int(self.fallback),
                    prefix_seconds=self.prefix_seconds, suffix_seconds=self.suffix_seconds,
                    draft_seconds=self.draft_seconds, hidden_draft_seconds=self.hidden_draft_seconds,
                    draft_forwards=self.draft_forwards, draft_tokens=self.draft_tokens, rollouts=self.rollouts,
                    branches_rolled=self.branches_rolled, omega_sum=self.omega_sum,
                    timeline=[self.timeline] if self.timeline else [])


class Generating(Protocol):
    """What a step reads of the generation (the engine's Generation): its options, what is committed, and how
    the target samples (sampling.row_sampler, the logits processors)."""

    @property
    def opts(self) -> DecodeOptions: ...
    @property
    def committed(self) -> list[int]: ...
    @property
    def gamma(self) -> int: ...
    @property
    def sampler(self) -> Callable[[mx.array, int], list[int]]: ...
    @property
    def processors(self) -> list[Callable]: ...


class Forwards(Protocol):
    """What a proposer calls of the engine (engine/loop.py's Engine): the target's forwards, the draft's windows."""

    def verify(self, gen: Generating, window: list[int], rec: StepRecord) -> StepRecord: ...

    def verify_tree(self, gen: Generating, tree: Tree, top: int) -> tuple[Walk, np.ndarray, float]: ...

    def sd_step(self, gen: Generating) -> StepRecord: ...

    def mirror_step(self, gen: Generating, m: "Mirror", window: list[int], from_lookup: bool, budget: int,
                    rec: StepRecord) -> StepRecord: ...

    def rollout(self, gen: Generating, rec: StepRecord) -> Optional[list[int]]: ...


Seen = Optional[tuple[list[int], np.ndarray]]  # a prefill's tokens and their rows' top ids (TargetSide.seen)
TimeWidths = Callable[[Sequence[int], int], dict[int, float]]  # TargetSide.time_widths, on the target's thread


class Proposer:
    """Proposes each step's window (none for the target alone) and has the target verify it, through the
    engine's `Forwards`. `index`: the prompt lookup's, where it proposes; `drafts`: a draft model runs, so a
    dropped or left draft hands over to `alone()`."""

    drafts = False
    recycle = ""  # Stats.recycle: the recycled tree's shape ("tree", or why one path)

    def __init__(self, engine: Forwards, index: Optional[Lookup] = None):
        self.engine, self.index, self.held = engine, index, 0

    def step(self, gen: Generating, budget: int) -> StepRecord:
        """One step of the generation `gen`, `budget` tokens still wanted."""
        return self.engine.verify(gen, [], StepRecord())

    def commit(self, new: Sequence[int]) -> int:
        """The generation committed `new`: how often the lookup held back since the last commit."""
        if self.index is None:
            return 0
        self.index.extend(new)
        held, self.held = self.index.held - self.held, self.index.held
        return held

    def alone(self) -> "Proposer":
        """What goes on without the draft model: the lookup's windows where it proposes, else the target alone."""
        if not self.drafts:
            return self
        out = LookupWindows(self.engine, self.index) if self.index is not None else TargetAlone(self.engine)
        out.held = self.held
        return out

    def first(self, gen: Generating) -> StepRecord:
        """Before the first step, after the prefill (mirror's first window): what it spent."""
        return StepRecord()

    def top_rows(self) -> int:
        """The top ids per row the target's prefill keeps (the recycled table learns them)."""
        return 0

    def prefilled(self, seen: Seen, time_widths: TimeWidths, row_cost: Optional[float]) -> None:
        """After the prefill: `seen`, its rows' tokens and top ids (with `top_rows`)."""


class TargetAlone(Proposer):
    """ar: the target alone proposes nothing; one token per forward."""


class LookupWindows(Proposer):
    """The prompt lookup's window where the context offers one, else `otherwise` (the target alone)."""

    def step(self, gen: Generating, budget: int) -> StepRecord:
        lookup = self.index.propose(min(gen.gamma, budget - 1)) if self.index is not None and budget > 1 else []
        if lookup:
            return self.engine.verify(gen, lookup, StepRecord(from_lookup=True))
        return self.otherwise(gen, budget)

    def otherwise(self, gen: Generating, budget: int) -> StepRecord:
        return super().step(gen, budget)


class RecycledTree(Proposer):
    """The recycled draft's tree (the lookup's proposal its first branch), verified in one forward; the table
    then learns every node's top candidates from that forward. `table` lives as long as the pipeline."""

    def __init__(self, engine: Forwards, index: Optional[Lookup], table: Recycled):
        super().__init__(engine, index)
        self.table = table
        self.recycle = table.one_path or "tree"

    def step(self, gen: Generating, budget: int) -> StepRecord:
        if budget < 2:
            return super().step(gen, budget)
        depth = min(DEPTH, budget - 1)
        lookup = self.index.propose(min(gen.gamma, depth)) if self.index is not None else []
        tree = self.table.grow(gen.committed[-1], lookup, depth, gen.opts.row_cost)
        out, top, seconds = self.engine.verify_tree(gen, tree, K)
        self.table.learn(tree, out.path, out.tokens, top)
        return StepRecord(out.tokens, len(tree) - 1, len(out.path), from_lookup=bool(lookup),
                          lookup_offered=tree.sources.count("lookup"),
                          lookup_accepted=sum(tree.sources[i] == "lookup" for i in out.path), suffix_seconds=seconds)

    def top_rows(self) -> int:
        return K

    def prefilled(self, seen: Seen, time_widths: TimeWidths, row_cost: Optional[float]) -> None:
        if seen is not None:  # the recycled table learns the prompt's rows
            self.table.learn_prefill(*seen)
        if self.table.widths is None and row_cost is None and not self.table.one_path:
            # once per pipeline: what a verify's rows cost on this machine (a recurrent target's chains: ROW_COST)
            self.table.widths = time_widths(WIDTHS, K)


class DraftWindows(LookupWindows):
    """sd: the lookup's window where it offers one, else the draft model's window, then the target verifies it
    (serial; the draft in process or in its host: `Engine.sd_step`); the last token is the target's own."""

    drafts = True

    def otherwise(self, gen: Generating, budget: int) -> StepRecord:
        return self.engine.sd_step(gen) if budget > 1 else super().otherwise(gen, budget)


class Mirror(Proposer):
    """Mirror-SD's step: the draft rolls out the next window for each likely correction beside the target's
    suffix (`Engine.mirror_step`); the lookup's window, where the context offers one, replaces a serial rollout.
    `window`: the next step's, when known; `plan`: which branches each step rolls out."""

    drafts = True

    def __init__(self, engine: Forwards, index: Optional[Lookup], plan: BranchBudget):
        super().__init__(engine, index)
        self.plan = plan
        self.window: Optional[list[int]] = None

    def first(self, gen: Generating) -> StepRecord:
        """The first window, drafted before the first step unless the lookup has one or one token is wanted
        (the target's own at the pending row, no window needed); None in `window` when the draft failed."""
        rec = StepRecord()
        if gen.opts.max_tokens > 1 and not (self.index is not None and self.index.propose(1)):
            self.window = self.engine.rollout(gen, rec)
        return rec

    def step(self, gen: Generating, budget: int) -> StepRecord:
        rec = StepRecord()
        window, from_lookup = self._window(gen, budget, rec)
        if window is None:  # a failed rollout dropped the draft: the target alone this step
            return self.engine.verify(gen, [], rec)
        rec = self.engine.mirror_step(gen, self, window, from_lookup, budget, rec)
        self.window = rec.window
        return rec

    def _window(self, gen: Generating, budget: int, rec: StepRecord) -> tuple[Optional[list[int]], bool]:
        """The step's window and whether the lookup proposed it: none when one token is wanted; the one the last
        step left; else the lookup's, else the draft's rollout, counted in `rec` (None if it failed)."""
        if budget == 1:
            return [], False
        if self.window is not None:
            return self.window, False
        proposal = self.index.propose(min(gen.gamma, budget - 1)) if self.index is not None else []
        if proposal:
            return proposal, True
        return self.engine.rollout(gen, rec), False


PROPOSERS: dict[str, type[Proposer]] = {"ar": TargetAlone, LOOKUP: LookupWindows, RECYCLE: RecycledTree,
                                        "sd": DraftWindows, "mirror": Mirror}
