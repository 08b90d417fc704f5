"""mlx-lm-shaped API: `generate` / `stream_generate` with mlx_lm's signature, Mirror-SD underneath.

    from mlx_lm import load
    from mirror_mlx import stream_generate          # instead of: from mlx_lm import stream_generate
    model, tokenizer = load(...); draft, _ = load(...)
    for r in stream_generate(model, tokenizer, prompt, draft_model=draft, max_tokens=100):
        print(r.text, end="")

As in mlx-lm, a string prompt is encoded as is (no chat template: template it yourself with
`tokenizer.apply_chat_template`). The records are mlx-lm's `GenerationResponse` plus our `stats`.
A Pipeline (its worker threads, its caches) is kept per (model, draft) pair, so repeated calls reuse
it; the last `KEEP` pairs stay, older ones are closed.

`prompt_cache=` is mlx-lm's: the list `mlx_lm.models.cache.make_prompt_cache(model)` returns (the
target's layers; mirror-mlx keeps the draft's cache itself), extended in place, so each turn's prompt
is only its new text:

    cache = make_prompt_cache(model)
    for turn in turns:
        for r in stream_generate(model, tokenizer, turn, draft_model=draft, prompt_cache=cache): ...
"""

import threading
import weakref
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Optional, Sequence, Union, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse
from mlx_lm.models.cache import ArraysCache, CacheList, trim_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .engine import recurrent
from .drafts.mlx_draft import MLXDraft
from .drafts.api import Draft
from .proposers.lookup import LOOKUP
from .proposers.recycle import RECYCLE
from .engine.stats import Stats
from .options import OPTION_NAMES
from .pipeline import Pipeline
from .text import as_is
from .prompt_cache import PromptCache

if TYPE_CHECKING:
    from .chunks import Chunk
    from mlx_lm.tokenizer_utils import TokenizerWrapper

KEEP = 2
# (mlx-lm's QuantizedKVCache does trim: what it cannot give is mlx-lm's tokens, as KV_BITS says)
KV_BITS = ("a quantized KV cache is not supported: mlx-lm quantizes the cache after the forward that reaches "
           "quantized_kv_start, and a speculative step's forward of several tokens crosses that point where "
           "mlx-lm's one-token forwards do not, so the tokens would differ from mlx-lm's; leave kv_bits unset "
           "(a model quantized in its weights, e.g. mlx-community's -4bit, works in every mode)")
_pipelines: dict = {}  # (id(model), id(draft_model), id(tokenizer)) -> (model, draft_model, tokenizer, Pipeline)
# a prompt_cache's first layer -> the ids our calls left in it (the draft needs them; mlx-lm keeps none)
_held_ids: "weakref.WeakKeyDictionary[Any, list[int]]" = weakref.WeakKeyDictionary()


@dataclass
class Response(GenerationResponse):
    """mlx-lm's GenerationResponse (one token, its text segment, speeds, finish_reason) and our stats.

    `logprobs` is the target's log-probabilities over the vocabulary at that token (its processed
    distribution, after the logits processors), as mlx-lm's.
    """

    stats: Optional[Stats] = None


def pipeline(model: nn.Module, tokenizer: "TokenizerWrapper",
             draft_model: Union[nn.Module, Draft, str, None] = None) -> Pipeline:
    """The cached Pipeline for this (model, draft, tokenizer), built on first use; draft_model="lookup": the
    prompt lookup alone (mirror_mlx/proposers/lookup.py), "recycle": the target's recycled predictions (recycle.py)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an mlx-lm model (as mlx_lm.load returns), not {type(model).__name__}: "
                        "for a path use mirror_mlx.load(path)")
    draftless = draft_model if isinstance(draft_model, str) and draft_model in (LOOKUP, RECYCLE) else None
    if draft_model is not None and not draftless and not isinstance(draft_model, (nn.Module, Draft)):
        raise TypeError(f"draft_model must be an mlx-lm model, a mirror_mlx Draft, \"lookup\" or \"recycle\", not "
                        f"{type(draft_model).__name__}")
    key = (id(model), id(draft_model), id(tokenizer))
    if key not in _pipelines:
        while len(_pipelines) >= KEEP:
            _pipelines.pop(next(iter(_pipelines)))[-1].close()
        if not isinstance(tokenizer, TokenizerWrapper):
            tokenizer = TokenizerWrapper(tokenizer)
        mx.eval(model.parameters(), draft_model.parameters() if isinstance(draft_model, nn.Module) else [])
        draft = MLXDraft(draft_model) if isinstance(draft_model, nn.Module) else \
            draft_model if isinstance(draft_model, Draft) else None
        # (lazy weights would be computed on the workers' threads, where the loading thread's stream does not exist)
        _pipelines[key] = (model, draft_model, tokenizer, Pipeline(model, tokenizer, draft, draftless=draftless))
    _pipelines[key] = _pipelines.pop(key)  # most recently used last
    return _pipelines[key][-1]


def given_cache(prompt_cache: list) -> PromptCache:
    """The caller's make_prompt_cache list as the engine's PromptCache: with the ids it holds when it is
    empty or our own calls filled it, else none (what mlx-lm put there is opaque: mode ar only). Ours are
    recognised by length: a cache that something else trimmed and refilled to that same length is not told apart.
    """
    opaque = False
    if isinstance(prompt_cache, list) and prompt_cache:  # recurrent layers made droppable in the caller's list
        opaque = any(type(x) is ArraysCache and not x.empty() for x in recurrent.leaves(prompt_cache)) \
            and recurrent.held(prompt_cache, -1) < 0  # state that no layer counts the tokens of
        recurrent.convert(prompt_cache, recurrent.held(prompt_cache))
    if not isinstance(prompt_cache, (list, tuple)) or not prompt_cache or \
            not all(hasattr(c, "state") and (hasattr(c, "offset") or isinstance(c, CacheList)) for c in prompt_cache):
        raise ValueError("prompt_cache must be the list mlx_lm.models.cache.make_prompt_cache(model) returns "
                         f"(got {'an empty ' if isinstance(prompt_cache, (list, tuple)) else ''}"
                         f"{type(prompt_cache).__name__})")
    cache = list(prompt_cache)
    mx.eval([c.state for c in cache])  # computed here: the target's worker thread cannot evaluate this thread's graph
    lengths = {recurrent.held([c]) for c in cache} if not opaque else {-1}
    known = _held_ids.get(cache[0])
    if lengths == {0}:
        tokens: Optional[list] = []
    elif len(lengths) == 1 and known is not None and len(known) == lengths.pop():
        tokens = list(known)
    else:
        tokens = None
    return PromptCache(cache, tokens, {}, origin="list")


def hand_back(given: PromptCache, start: int, ids: list[int], yielded: list[int]) -> None:
    """Leave the caller's cache as mlx-lm would after these records: its `start` rows, the prompt and every
    yielded token (the engine left every committed one: the rest of a step that the caller did not take
    is trimmed; after an error, a prefix of them), and remember the ids when they are known."""
    extra = given.length - start - len(ids) - len(yielded)
    trimmed = extra <= 0 or trim_prompt_cache(given.cache, extra) == extra
    if trimmed and given.tokens is not None and len({recurrent.held([c]) for c in given.cache}) == 1:
        _held_ids[given.cache[0]] = (list(given.tokens) + list(ids) + list(yielded))[: given.length]
    else:
        _held_ids.pop(given.cache[0], None)


def close_all() -> None:
    """Close every cached Pipeline (their worker threads); runs at exit, before the thread pools shut down."""
    while _pipelines:
        _pipelines.popitem()[-1][-1].close()


def _records(chunk: "Chunk", stats: Optional[Stats]) -> Iterator[Response]:
    """One chunk as mlx-lm's records, one per token (and one for an end-of-sequence token); `stats` rides on
    the last record of the generation."""
    last = len(chunk.tokens) - 1
    done = chunk.generation_tokens - len(chunk.tokens) - (chunk.stop_token is not None)
    record = partial(Response, prompt_tokens=chunk.prompt_tokens, prompt_tps=chunk.prompt_tps,
                     generation_tps=chunk.generation_tps, peak_memory=chunk.peak_memory)
    for i, (token, text, drafted, logprobs) in enumerate(zip(chunk.tokens, chunk.token_texts, chunk.from_draft,
                                                              chunk.logprobs)):
        final = chunk.finish_reason == "length" and i == last
        yield record(text=text + (chunk.text[len("".join(chunk.token_texts)):] if final else ""),
                     token=token, logprobs=logprobs, from_draft=drafted, generation_tokens=done + i + 1,
                     finish_reason="length" if final else None, stats=stats if final else None)
    if chunk.stop_token is not None:  # finish "stop": as mlx-lm, a last record carries the end-of-sequence token
        assert chunk.stop_logprobs is not None, "the engine's steps carry the target's logprobs"
        yield record(text=chunk.text[len("".join(chunk.token_texts)):], token=chunk.stop_token,
                     logprobs=chunk.stop_logprobs, from_draft=chunk.stop_from_draft,
                     generation_tokens=chunk.generation_tokens, finish_reason="stop", stats=stats)


def stream_generate(model: nn.Module, tokenizer: "TokenizerWrapper", prompt: Union[str, mx.array, List[int]],
                    max_tokens: int = 256, draft_model: Union[nn.Module, Draft, str, None] = None, *,
                    sampler: Optional[Callable[[mx.array], mx.array]] = None,
                    logits_processors: Optional[Sequence[Callable]] = None, prompt_cache: Any = None,
                    max_kv_size: Optional[int] = None, num_draft_tokens: Optional[int] = None,
                    kv_bits: Optional[int] = None, kv_group_size: int = 64, quantized_kv_start: int = 5000,
                    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
                    mode: Optional[str] = None, seed: Optional[int] = None, **knobs: Any) -> Iterator[Response]:
    """mlx_lm.stream_generate, one record per committed token; `mode` defaults to mirror with a draft model, sd
    with "lookup" or "recycle".

    `seed` makes sampling mode-invariant (the draw for each position is keyed by (seed, position));
    `num_draft_tokens` (mlx-lm's window) is γ; `knobs` are Pipeline.generate's: kappa, gamma, exit_layer,
    temperature, top_p, top_k, min_p, repetition_penalty, prefill_step_size (mlx-lm's, the prompt tokens
    per target forward) (`sampler=` replaces the sampling settings: mlx-lm's make_sampler with xtc works).

    `prompt_progress_callback(processed, total)` is called as mlx-lm calls it: (0, total) before the prefill,
    after each chunk of `prefill_step_size` tokens (from the target's worker thread), and (total, total) once
    the first token is out. `kv_bits` is refused (see KV_BITS); `kv_group_size` and
    `quantized_kv_start` only matter with it, as in mlx-lm.

    `prompt_cache`: make_prompt_cache(model)'s list, extended in place as mlx-lm does: afterwards it holds
    what it held, the prompt and every token yielded (the last, and an end-of-sequence token, included),
    also when the caller stops early (after an error: a prefix of those, the rows known to be right); the
    prompt is only what follows the cached text. Every mode works on a cache that is empty or that only
    these calls filled (their ids are remembered for the draft); one that mlx-lm filled, or a
    RotatingKVCache (make_prompt_cache's max_kv_size), works in mode "ar" only. While the stream runs the
    cache is the stream's. As mlx-lm, `max_kv_size` is ignored when a prompt_cache is given (the cache's
    own layers decide).
    """
    unknown = sorted(set(knobs) - set(OPTION_NAMES) - {"stop_tokens"})
    if unknown:
        raise TypeError(f"stream_generate() does not take {', '.join(unknown)}: mirror-mlx takes mlx-lm's "
                        "max_tokens, draft_model, sampler, logits_processors, max_kv_size, num_draft_tokens, "
                        "prefill_step_size, prompt_progress_callback, kv_bits (refused), kv_group_size, "
                        "quantized_kv_start and its own mode, seed, kappa, gamma, exit_layer")
    if kv_bits is not None:
        raise ValueError(f"kv_bits={kv_bits}: {KV_BITS}")
    if num_draft_tokens is not None:
        knobs["gamma"] = num_draft_tokens
    if max_tokens == 0 or max_tokens < -1:
        raise ValueError(f"max_tokens must be positive or -1 for no limit (got {max_tokens})")
    given = None
    if prompt_cache is not None:
        given = given_cache(prompt_cache)
        max_kv_size = None  # as mlx-lm: a given cache is used as it is
    pipe = pipeline(model, tokenizer, draft_model)
    if isinstance(prompt, mx.array):  # (1-D, as mlx-lm takes it: mlx's stub says a scalar or any nesting)
        prompt = cast(List[int], prompt.tolist())
    ids = as_is(pipe.tokenizer, prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    start = given.length if given is not None else 0
    mode = mode or ("sd" if pipe.draftless else "mirror" if draft_model is not None else "ar")  # (no model: sd)
    plan = pipe.check(ids, given, cap=max_tokens == -1, max_tokens=2 ** 20 if max_tokens == -1 else max_tokens,
                      mode=mode, seed=seed, sampler=sampler, logits_processors=logits_processors or (),
                      max_kv_size=max_kv_size, prompt_progress_callback=prompt_progress_callback, **knobs)
    chunks = pipe.run(plan)
    yielded: list[int] = []  # every token a record carried: what a prompt_cache holds after the prompt
    progress = prompt_progress_callback or (lambda *_: None)
    progress(0, len(ids))
    try:
        for i, chunk in enumerate(chunks):
            if i == 0:  # the first token is out
                progress(len(ids), len(ids))
            for record in _records(chunk, pipe.stats if chunk.finish_reason else None):
                yielded.append(record.token)
                yield record
    finally:  # (also when the caller stops early: the cache keeps what was yielded, as mlx-lm's does)
        chunks.close()  # the engine hands the prompt cache back, holding every committed token
        if given is not None:
            hand_back(given, start, ids, yielded)


def generate(model: nn.Module, tokenizer: "TokenizerWrapper", prompt: Union[str, List[int]], verbose: bool = False,
             **kwargs: Any) -> str:
    """mlx_lm.generate: the whole text; `verbose` prints it as it comes, then mlx-lm's timing lines."""
    if verbose:
        print("=" * 10)
    text, response = "", None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        if response is None or not text:
            print("No text generated for this prompt")
            return text
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
        if response.stats is not None:
            print(f"Mirror-SD: {response.stats.summary()}")
    return text


# At exit, close the cached pipelines before the interpreter joins threads: concurrent.futures joins its pools'
# threads (asyncio.to_thread's too, where a generation may still run) from a hook registered here, and these hooks
# run in reverse, so ours comes first. atexit's handlers run only after those joins: CPython has no public hook
# that runs before them.
threading._register_atexit(close_all)  # type: ignore[attr-defined]  # (CPython's, private: typeshed omits it)
