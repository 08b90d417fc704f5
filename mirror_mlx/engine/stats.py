"""What a generation did: a `Step` record per step (its tokens and their facts, as mlx-lm's
speculative_generate_step yields them) and the generation's `Stats` (what `--json` prints)."""

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import mlx.core as mx


@dataclass
class Stats:
    """What one generation did; `as_dict()` is what `--json` prints."""

    mode: str = "ar"  # what ran (ar after a dropped draft)
    chosen_mode: str = ""  # what was chosen, and with which knobs and why
    kappa: Optional[int] = None
    gamma: Optional[int] = None
    exit_layer: Optional[int] = None
    branches: Optional[int] = None  # the branch budget B (None: every branch rolled out)
    why: str = ""
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually run through the target (the rest came from its cache)
    generation_tokens: int = 0
    target_forwards: int = 0  # decode forwards of the target (one per step)
    draft_forwards: int = 0  # every draft forward the rollouts ran, syncing included (J per rollout)
    draft_tokens: int = 0  # per-branch tokens those forwards emitted (η̄ = draft_tokens / draft_forwards)
    rollouts: int = 0
    branches_rolled: int = 0  # mirror: branches the draft rolled out beside the target's suffix, over all steps
    steps: int = 0
    reuses: int = 0
    fallbacks: int = 0
    proposed: int = 0  # draft tokens the target verified
    accepted: int = 0  # of them, accepted
    # steps whose window had a token rejected (acceptance_rate = accepted / (accepted + rejections))
    rejections: int = 0
    lookup: bool = False  # the prompt lookup proposed where the context offered a continuation
    lookup_windows: int = 0  # steps whose window was the prompt lookup's (mirror_mlx/proposers/lookup.py), no draft's
    lookup_proposed: int = 0  # of `proposed`, the lookup's tokens
    lookup_accepted: int = 0  # of `accepted`, the lookup's (the rest are the model draft's)
    lookup_rejections: int = 0  # of `rejections`, in the lookup's windows
    recycle: str = ""  # the recycled draft proposed: "tree", or "one path: why" (a target that takes no tree)
    lookup_held: int = 0  # steps whose context offered a continuation the lookup held back: at the acceptance seen
    # so far in this generation no window of it paid for its verify (mirror_mlx/proposers/lookup.py, best_length)
    omega_sum: float = 0.0  # target mass inside the posted C_A at each correction row
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefix_seconds: float = 0.0
    suffix_seconds: float = 0.0  # target suffix (mirror) or whole verify forward (sd, ar)
    draft_seconds: float = 0.0  # all draft rollout time: branch rollouts, fallbacks, first window
    hidden_draft_seconds: float = 0.0  # draft time that overlapped the target's suffix
    draft_failure: Optional[str] = None
    left_draft: str = ""  # after which step and why it went on with the target alone (the caller's `leave_draft`)
    placement: str = ""  # where the threads ran, and why (tune/placement.py): "unpinned (...)", "split: ..."
    draft_host: str = ""  # where the draft ran: "process" (its own, the default for load) or "thread"
    draft_vocab: Optional[int] = None  # the ids the draft's trimmed head scores (None: its whole vocabulary)
    peak_memory_gb: float = 0.0
    timeline: list = field(default_factory=list, repr=False)  # per step (prefix, suffix, rollout) intervals

    # the ratios `as_dict` reports; α = acceptance_rate: the chance that a draft token after a right prefix
    # is right (each accepted token is one such event, each rejection one of the other kind)
    mean_accepted = property(lambda s: s.generation_tokens / max(s.target_forwards, 1))
    fallback_rate = property(lambda s: s.fallbacks / max(s.steps, 1))
    reuse_rate = property(lambda s: s.reuses / max(s.steps, 1))
    acceptance_rate = property(lambda s: s.accepted / max(s.accepted + s.rejections, 1))
    omega_kappa = property(lambda s: s.omega_sum / max(s.steps, 1))
    hidden_draft_fraction = property(lambda s: s.hidden_draft_seconds / s.draft_seconds if s.draft_seconds else 0.0)
    tokens_per_second = property(lambda s: s.generation_tokens / s.decode_seconds if s.decode_seconds else 0.0)
    eta = property(lambda s: s.draft_tokens / max(s.draft_forwards, 1))  # η̄: tokens per draft forward
    draft_forwards_per_window = property(lambda s: s.draft_forwards / max(s.rollouts, 1))
    branches_per_step = property(lambda s: s.branches_rolled / max(s.steps, 1))

    def __add__(self, other: "Stats") -> "Stats":
        """Totals over generations (chat's /stats, bench, scripts): counts, seconds and timelines add up,
        peak memory is the largest; mode, the chosen mode and knobs and a draft failure are the latest."""
        out = Stats(mode=other.mode, draft_failure=other.draft_failure or self.draft_failure,
                    draft_host=other.draft_host, timeline=self.timeline + other.timeline)
        for f in fields(Stats):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name in _LATEST:
                setattr(out, f.name, b)
            elif f.name == "peak_memory_gb":
                setattr(out, f.name, max(a, b))
            elif isinstance(a, (int, float)) and not isinstance(a, bool):
                setattr(out, f.name, a + b)
        return out

    def as_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "timeline"}
        for name in ("mean_accepted", "acceptance_rate", "fallback_rate", "reuse_rate", "omega_kappa",
                     "hidden_draft_fraction", "tokens_per_second", "eta", "draft_forwards_per_window",
                     "branches_per_step"):
            d[name] = getattr(self, name)
        return d

    def summary(self) -> str:
        line = (f"{self.tokens_per_second:.1f} tok/s | {self.mean_accepted:.2f} accepted/forward"
                f" | mode {self.mode}")
        if self.mode == "mirror":
            line += f" κ={self.kappa} γ={self.gamma} ℓe={self.exit_layer}"
            if self.branches is not None:
                line += f" B={self.branches}"
        elif self.mode == "sd":
            line += f" γ={self.gamma}"
        if self.draft_vocab is not None and self.mode != "ar":
            line += f" | draft vocab {self.draft_vocab}"
        if self.recycle:
            line += (" | accepted: recycled "
                     f"{self.accepted - self.lookup_accepted}/{self.proposed - self.lookup_proposed}"
                     + (f", lookup {self.lookup_accepted}/{self.lookup_proposed}" if self.lookup else ""))
        elif self.lookup:
            line += f" | accepted: lookup {self.lookup_accepted}/{self.lookup_proposed}"
            if self.lookup_held:
                line += f" (held back {self.lookup_held}x)"
            if self.draft_host or self.proposed > self.lookup_proposed:  # a draft model ran beside it
                line += f", draft {self.accepted - self.lookup_accepted}/{self.proposed - self.lookup_proposed}"
        if self.why.startswith(("auto", "quick")):
            line += f" ({self.why})"
        if self.mode == "mirror":
            line += (f" | fallback {100 * self.fallback_rate:.0f}% | reuse {100 * self.reuse_rate:.0f}%"
                     f" | hidden draft {100 * self.hidden_draft_fraction:.0f}%")
            if self.branches is not None:  # under a budget: how many it rolled out
                line += f" | {self.branches_per_step:.1f} branches/step"
            if self.placement.startswith("split"):
                line += " | cores split"
        if self.left_draft:
            line += f" | left the draft {self.left_draft}"
        if self.draft_failure:
            line += f" | draft dropped: {self.draft_failure}"
        return line


# Stats fields a total keeps the latest of
_LATEST = ("lookup", "recycle", "chosen_mode", "kappa", "gamma", "exit_layer", "branches", "why", "left_draft",
           "placement", "draft_vocab")


@dataclass
class Step:
    """What one step committed (as mlx-lm's speculative_generate_step yields tokens with `from_draft`) and how
    its window fared. `stats`: this step's own counts and seconds (the first's also the prefill's) and what
    describes the generation as it stands; a generation's Stats is the sum of its steps'."""

    tokens: list[int]
    from_draft: list[bool]
    offered: int = 0  # draft tokens the target verified in this step
    accepted: int = 0  # of them, accepted
    reused: bool = False  # mirror: the next window was a branch already rolled out
    fallback: bool = False  # mirror: it was not (a serial rollout, or none)
    stats: Stats = field(default_factory=Stats, repr=False)
    # row i: the target's log-probabilities (its processed distribution, as mlx-lm reports them) at tokens[i]
    logprobs: Optional["mx.array"] = field(default=None, repr=False)
    # when it ran, on time.perf_counter's clock (the first step's from the prefill's end), as its stats'
    # per-interval times are: a picture of the steps (timeline.py) places them on one axis
    span: tuple = (0.0, 0.0)
