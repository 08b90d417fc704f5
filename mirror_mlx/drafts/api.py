"""What the engine asks of a draft, whatever runs it (MLX thread, SS model, Core ML process)."""

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, runtime_checkable


@dataclass
class Rollout:
    """Greedy draft continuations, one per stem, and what they cost."""

    windows: list[list[int]]  # windows[i]: `gamma` tokens that follow context + stems[i]
    forwards: int  # every draft forward the rollout ran (J), cache syncing included
    tokens: int  # draft tokens emitted per branch summed over forwards / forwards gives eta-bar


@runtime_checkable
class Draft(Protocol):
    """A draft keeps a KV cache of committed tokens only; branch rows are scratch.

    `rollout(context, stems, gamma)`: `context` is every committed token so far (the draft syncs its cache
    to it); each stem is a non-empty list of tokens after it (accepted draft tokens plus one early-exit
    candidate), all rolled out together, batched. A draft may also offer `sync(context)`: the engine then
    prefills it while the target prefills, so the first window costs no prefill forward on the decode clock.
    """

    @property
    def vocab_size(self) -> Optional[int]: ...  # (None: the model does not say)

    def reset(self) -> None: ...

    def rollout(self, context: Sequence[int], stems: Sequence[Sequence[int]], gamma: int) -> Rollout: ...
