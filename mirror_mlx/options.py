"""How to decode, written once: the modes, Mirror-SD's knobs, the sampling settings, and every default (the
API, the command line and the benchmark read them here). No MLX import, so `--help` shows them without it.
"""

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from .proposers.lookup import NGRAM_MAX

if TYPE_CHECKING:
    import mlx.core as mx

MODES = ("mirror", "sd", "ar")  # what the engine runs
CHOICES = ("auto",) + MODES  # what a caller may ask for: auto is resolved by the Pipeline (mirror_mlx.tune.policy)
PAPER_KNOBS = dict(kappa=8, gamma=7)  # the paper's κ, γ: what bad input is checked against before knobs are chosen
DRAFT_TIMEOUT_S = 60.0  # a draft (host) that answers no request in this long is dropped, visibly


def default_exit_layer(n_layers: int) -> int:
    """ℓ_e = N/2, the paper's default (at least 1)."""
    return max(1, n_layers // 2)


@dataclass
class DecodeOptions:
    """How to decode: the mode, Mirror-SD's knobs and the target's sampling settings (mlx-lm's)."""

    mode: str = "auto"  # Pipeline.prepare resolves "auto" (mirror_mlx.tune) before the engine sees it
    max_tokens: int = 256
    kappa: Optional[int] = None  # None: the pair's profile's (auto's choice, or its best for an explicit mode)
    gamma: Optional[int] = None  # None: as kappa (mirror_mlx.tune.policy.explicit)
    exit_layer: Optional[int] = None  # None: the exit adapter's layer, else default_exit_layer (N/2)
    branches: Optional[int] = None  # B: mirror rolls out the top-B of its κ(γ+1) branches a step; None: those that
    # pay, by the generation's own timings (those that hide beside the suffix, and past it those worth their row)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop_tokens: Sequence[int] = ()
    draft_timeout: float = DRAFT_TIMEOUT_S  # seconds; a draft slower than this is dropped (visible switch to ar)
    sampler: Optional[Callable[["mx.array"], "mx.array"]] = None  # mlx-lm's sampler= (replaces temperature..min_p)
    logits_processors: Sequence[Callable] = ()  # mlx-lm's logits_processors=, after repetition_penalty
    max_kv_size: Optional[int] = None  # mlx-lm's rotating cache size: accepted when the context never rotates
    prefill_step_size: int = 2048  # prompt tokens per target forward in the prefill (mlx-lm's, same default)
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None  # mlx-lm's: (prompt tokens done, total)
    why: str = ""  # how the mode and knobs were chosen (set by the Pipeline, shown in Stats)
    placement: str = ""  # where the threads ran and why (set by the Pipeline: tune/placement.py, shown in Stats)
    lookup: Optional[bool] = None  # prompt lookup proposes what the context offers (sd, mirror); None: draft "lookup"
    ngram_max: int = NGRAM_MAX  # the lookup's longest n-gram, tried first
    ngram_min: Optional[int] = None  # and its shortest; None: 1 alone (NGRAM_MIN), 2 beside a draft model
    row_cost: Optional[float] = None  # the lookup weighs its windows' verify rows at this (one-row forwards per row
    # past the first); None: the pair's measured verify, else ROW_COST; 0: every row free (each proposal whole)

    @property
    def sampling(self) -> Optional[tuple]:
        """The settings the target's processed distribution depends on, as a key: auto adapts to the
        acceptance seen at each (mirror_mlx.tune.policy.adapt). None for a custom sampler or logits processors,
        which auto cannot tell apart."""
        if self.sampler is not None or self.logits_processors:
            return None
        if self.temperature == 0:  # mlx-lm's greedy sampler ignores top_p, top_k and min_p
            return (0.0, self.repetition_penalty)
        return (self.temperature, self.top_p, self.top_k, self.min_p, self.repetition_penalty)


OPTION_NAMES = tuple(f.name for f in fields(DecodeOptions))
CALLER_OPTIONS = tuple(n for n in OPTION_NAMES if n not in ("stop_tokens", "why", "placement"))  # set by the Pipeline


def given(opts: DecodeOptions) -> dict:
    """The caller's options that differ from the defaults, as keywords (a request sent to other ranks)."""
    default = DecodeOptions()
    return {n: getattr(opts, n) for n in CALLER_OPTIONS if getattr(opts, n) != getattr(default, n)}


@dataclass(frozen=True)
class Plan:
    """One call as a value, made once (`validate.request`), never rebuilt: the prompt ids, the options checked
    and the caller's as given; `Pipeline.resolve` fills in the concrete mode, knobs and mode auto's watch."""

    ids: list  # after a prompt cache's prefix: its ids (when known), then the rest
    opts: DecodeOptions
    asked: DecodeOptions  # mode auto and knobs left out, as the caller gave them: what resolution fills in
    prompt_cache: Any = None  # mirror_mlx.prompt_cache.PromptCache
    run: Any = None  # mirror_mlx.tune.policy.AutoRun, once resolved
    resolved: bool = False

    def after(self, tokens: list) -> "Plan":
        """The same call going on after `tokens` it committed (a server's request back from the batch): the
        context fit holds, as the total is the same."""
        left = self.opts.max_tokens - len(tokens)
        return replace(self, ids=self.ids + tokens, opts=replace(self.opts, max_tokens=left),
                       asked=replace(self.asked, max_tokens=left))
