"""A generation's committed tokens → text: `Detokenizer` (mlx-lm's streaming detokenizer, end-of-sequence
tokens dropped, the finish reason) serves the pipeline's steps and the server's batch rows alike;
`Chunk` and `Result` are what callers get."""

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Optional, Sequence

import mlx.core as mx

from .engine.stats import Stats, Step

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


@dataclass
class Result:
    """One generation: the text, the generated token ids, and what it cost (see `Stats`)."""

    text: str
    tokens: list[int]
    stats: Stats
    finish_reason: str = "length"  # "stop" when an end-of-sequence token ended it
    from_draft: list[bool] = field(default_factory=list)  # per token: the draft proposed it (see Chunk)


@dataclass
class Chunk:
    """Text committed by one step, with mlx-lm's GenerationResponse fields. `from_draft[i]`: `tokens[i]` was
    the draft's (accepted) proposal. `finish_reason`: None until the last chunk, then "stop" (`stop_token`
    the end-of-sequence token, which `tokens` leaves out) or "length"."""

    text: str
    tokens: list[int] = field(default_factory=list)
    from_draft: list[bool] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_token: Optional[int] = None
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tokens: int = 0  # committed so far, this chunk's included (an end-of-sequence token too)
    generation_tps: float = 0.0
    peak_memory: float = 0.0  # GB, so far
    token_texts: list[str] = field(default_factory=list, repr=False)  # the text each token completed
    stop_from_draft: bool = False  # the end-of-sequence token (if any) was the draft's proposal
    # per token (and for stop_token): the target's log-probabilities over the vocabulary, as mlx-lm's
    # GenerationResponse.logprobs (the processed distribution the token was chosen from)
    logprobs: list = field(default_factory=list, repr=False)
    stop_logprobs: Optional[mx.array] = field(default=None, repr=False)
    step: Optional[Step] = field(default=None, repr=False)  # the engine's step (its own stats, when it ran), no rows

    def __str__(self) -> str:
        return self.text

    @property
    def committed(self) -> list[int]:
        """Every token this step committed: `tokens`, then the end-of-sequence token if it stopped."""
        return self.tokens + ([self.stop_token] if self.stop_token is not None else [])

    @property
    def committed_logprobs(self) -> list:
        """`logprobs` of each of `committed`."""
        return self.logprobs + ([self.stop_logprobs] if self.stop_token is not None else [])


class Detokenizer:
    """One generation's tokens → text as they are committed (end-of-sequence tokens dropped) and the finish
    reason; a server's request keeps one across its switches between decoding alone and in the batch."""

    def __init__(self, tokenizer: "TokenizerWrapper", max_tokens: int, stop_tokens: Sequence[int] = ()):
        self.detok, self.max_tokens, self.stop_tokens = tokenizer.detokenizer, max_tokens, tuple(stop_tokens)
        self.produced = 0
        self.detok.reset()

    def add(self, tokens: Sequence[int], stop: Optional[int]) -> tuple[list[str], str, Optional[str]]:
        """(each shown token's text, the text the finish flushed after the last of them or, with none shown,
        alone, the finish reason) for newly committed `tokens`; `stop`: the end-of-sequence token among them."""
        self.produced += len(tokens)
        texts = []
        for t in tokens:
            if t != stop:
                self.detok.add_token(t)
                texts.append(self.detok.last_segment)
        finish = "stop" if stop is not None else "length" if self.produced >= self.max_tokens else None
        tail = ""
        if finish is not None:
            self.detok.finalize()
            tail = self.detok.last_segment
            if texts:
                texts[-1], tail = texts[-1] + tail, ""
        return texts, tail, finish

    def chunk(self, step: Step, s: Stats) -> Chunk:
        """One engine step as a Chunk; `s`: the generation's stats so far, this step's included."""
        new = step.tokens
        stop = next((t for t in new if t in self.stop_tokens), None)
        rows = [None] * len(new) if step.logprobs is None else [step.logprobs[i] for i in range(len(new))]
        texts, tail, finish = self.add(new, stop)
        return Chunk("".join(texts) + tail, [t for t in new if t != stop],
                     [d for t, d in zip(new, step.from_draft) if t != stop], finish, stop,
                     s.prompt_tokens, s.prompt_tokens / s.prefill_seconds if s.prefill_seconds else 0.0,
                     self.produced, self.produced / s.decode_seconds if s.decode_seconds else 0.0,
                     mx.get_peak_memory() / 1e9, texts, step.from_draft[-1] if step.from_draft else False,
                     [r for t, r in zip(new, rows) if t != stop], rows[-1] if stop is not None else None,
                     replace(step, logprobs=None))


def kept(chunk: Chunk) -> Chunk:
    """A chunk as a whole generation keeps it: without its vocabulary-sized logprobs rows (a Result has
    none, and a long generation would hold a row per token)."""
    return replace(chunk, logprobs=[], stop_logprobs=None)


def result(parts: list[Chunk], stats: Stats, finish_reason: str) -> Result:
    """One generation's chunks as a Result."""
    return Result("".join(c.text for c in parts), [t for c in parts for t in c.tokens], stats, finish_reason,
                  [d for c in parts for d in c.from_draft])
