"""The target's choice at each row, exactly as mlx-lm's generate_step would make it, and seeds keyed by
absolute position so that ar, sd and mirror sample the same tokens."""

from typing import TYPE_CHECKING, Callable, Optional

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler, make_logits_processors, make_sampler

from .readback import ints

if TYPE_CHECKING:
    from ..options import DecodeOptions


def samplers(opts: "DecodeOptions") -> tuple[Callable[[mx.array], mx.array], list[Callable]]:
    """mlx-lm's sampler and logits processors for these options, as mlx_lm.generate makes them (the caller's
    own sampler if given): one rule for the engine (`row_sampler`) and the server's batch (`keyed`)."""
    sampler = opts.sampler or make_sampler(opts.temperature, top_p=opts.top_p if opts.top_p < 1.0 else 0.0,
                                           min_p=opts.min_p, top_k=opts.top_k)
    processors = make_logits_processors(repetition_penalty=opts.repetition_penalty) + list(opts.logits_processors)
    return sampler, processors


def sample_rows(logits: mx.array, history: list[int], window: list[int], sampler,
                processors) -> tuple[list[int], mx.array]:
    """The target's token at every row, exactly as mlx-lm's generate_step would choose it, and the rows'
    log-probabilities (what mlx-lm reports as `logprobs`). Row j follows history + window[:j], which its logits
    processors see; `sampler` (a `row_sampler`) gets row 0's absolute position, len(history)."""
    if processors:
        rows = []
        for j in range(logits.shape[0]):
            row = logits[j : j + 1]
            tokens = mx.array(list(history) + list(window[:j]))
            for p in processors:
                row = p(tokens, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return checked(sampler(logprobs, len(history)), logprobs.shape), logprobs


def checked(ys: list, shape: tuple[int, ...]) -> list[int]:
    """The sampler's tokens, one int id in [0, vocab) per row; anything else names the sampler (a wrong id
    would be committed as if the target had chosen it)."""
    rows, vocab = shape
    if not isinstance(ys, list) or len(ys) != rows or not all(isinstance(y, int) and 0 <= y < vocab for y in ys):
        raise ValueError(f"the sampler returned {str(ys)[:80]} for {rows} rows of log-probabilities: a sampler "
                         f"maps an array (rows, {vocab}) to one token id per row, each in [0, {vocab})")
    return ys


def position_seed(seed: int, position: int) -> int:
    """A 64-bit seed for (seed, absolute position) (splitmix64): independent draws per position."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def token_ids(outs: list) -> list:
    """The sampler's outputs (mx.arrays of token ids) as one list; `checked` then checks each row's id."""
    if not all(isinstance(o, mx.array) for o in outs):
        bad = next(o for o in outs if not isinstance(o, mx.array))
        raise ValueError(f"the sampler returned a {type(bad).__name__}: a sampler returns an mx.array of token ids, "
                         "one per row of the log-probabilities it is given")
    try:
        return ints(outs[0].reshape(-1) if len(outs) == 1 else mx.concatenate([o.reshape(-1) for o in outs]))
    except ValueError as e:
        raise ValueError(f"the sampler's output could not be read as token ids ({e}): a sampler returns an mx.array "
                         "of token ids, one per row") from None


def row_sampler(sampler: Callable[[mx.array], mx.array], seed: Optional[int]) -> Callable[[mx.array, int], list[int]]:
    """`sampler` (mlx-lm's) over rows whose first row samples absolute position `first`. With a seed, the draw
    for position p is keyed by (seed, p), not by how many draws came before, so every mode commits the same."""
    if seed is None or sampler is greedy_sampler:
        return lambda logprobs, first: token_ids([sampler(logprobs)])

    def sample(logprobs: mx.array, first: int) -> list[int]:
        rows = []
        for j in range(logprobs.shape[0]):
            mx.random.seed(position_seed(seed, first + j))  # the key is taken now, when the graph is built
            rows.append(sampler(logprobs[j : j + 1]))
        return token_ids(rows)

    return sample


def keyed(sampler: Callable, seed: Optional[int], first: int) -> Callable:
    """A batch row's sampler whose draw for position p is keyed by (seed, p), as `row_sampler`'s: the batch
    calls it once per step, for positions first, first + 1, ... (unseeded or greedy: `sampler` itself)."""
    if seed is None or sampler is greedy_sampler:
        return sampler
    position = [first]

    def sample(logprobs: mx.array) -> mx.array:
        mx.random.seed(position_seed(seed, position[0]))
        position[0] += 1
        return sampler(logprobs)

    return sample
