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
"""

import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .draft import MLXDraft
from .draft_api import Draft
from .engine import Stats
from .options import OPTION_NAMES
from .pipeline import Pipeline, encode

KEEP = 2
_pipelines: dict = {}  # (id(model), id(draft_model), id(tokenizer)) -> (model, draft_model, tokenizer, Pipeline)


@dataclass
class Response(GenerationResponse):
    """mlx-lm's GenerationResponse (one token, its text segment, speeds, finish_reason) and our stats.

    `logprobs` is None: the engine does not keep the target's full distribution per committed token.
    """

    stats: Optional[Stats] = None


def pipeline(model: nn.Module, tokenizer: Any, draft_model: Union[nn.Module, Draft, None] = None) -> Pipeline:
    """The cached Pipeline for this (model, draft, tokenizer), built on first use."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an mlx-lm model (as mlx_lm.load returns), not {type(model).__name__}: "
                        "for a path use mirror_mlx.load(path)")
    if draft_model is not None and not isinstance(draft_model, (nn.Module, Draft)):
        raise TypeError(f"draft_model must be an mlx-lm model or a mirror_mlx Draft, not {type(draft_model).__name__}")
    key = (id(model), id(draft_model), id(tokenizer))
    if key not in _pipelines:
        while len(_pipelines) >= KEEP:
            _pipelines.pop(next(iter(_pipelines)))[-1].close()
        if not isinstance(tokenizer, TokenizerWrapper):
            tokenizer = TokenizerWrapper(tokenizer)
        mx.eval(model.parameters(), draft_model.parameters() if isinstance(draft_model, nn.Module) else [])
        draft = MLXDraft(draft_model) if isinstance(draft_model, nn.Module) else draft_model  # (lazy weights
        # would be computed on the workers' threads, where the loading thread's stream does not exist)
        _pipelines[key] = (model, draft_model, tokenizer, Pipeline(model, tokenizer, draft))
    _pipelines[key] = _pipelines.pop(key)  # most recently used last
    return _pipelines[key][-1]


def close_all() -> None:
    """Close every cached Pipeline (their worker threads); runs at exit, before the thread pools shut down."""
    while _pipelines:
        _pipelines.popitem()[-1][-1].close()


def stream_generate(model: nn.Module, tokenizer: Any, prompt: Union[str, mx.array, List[int]],
                    max_tokens: int = 256, draft_model: Union[nn.Module, Draft, None] = None, *,
                    sampler: Optional[Callable[[mx.array], mx.array]] = None,
                    logits_processors: Optional[Sequence[Callable]] = None, prompt_cache: Any = None,
                    max_kv_size: Optional[int] = None, num_draft_tokens: Optional[int] = None,
                    mode: Optional[str] = None, seed: Optional[int] = None, **knobs: Any) -> Iterator[Response]:
    """mlx_lm.stream_generate, one record per committed token; `mode` defaults to mirror with a draft.

    `seed` makes sampling mode-invariant (the draw for each position is keyed by (seed, position));
    `num_draft_tokens` (mlx-lm's window) is γ; `knobs` are Pipeline.generate's: kappa, gamma, exit_layer,
    temperature, top_p, top_k, min_p, repetition_penalty (`sampler=` replaces the sampling settings).
    """
    unknown = sorted(set(knobs) - set(OPTION_NAMES) - {"stop_tokens"})
    if unknown:
        raise TypeError(f"stream_generate() does not take {', '.join(unknown)}: mirror-mlx takes mlx-lm's "
                        "max_tokens, draft_model, sampler, logits_processors, max_kv_size, num_draft_tokens and "
                        "its own mode, seed, kappa, gamma, exit_layer")
    if num_draft_tokens is not None:
        knobs["gamma"] = num_draft_tokens
    if max_tokens == 0 or max_tokens < -1:
        raise ValueError(f"max_tokens must be positive or -1 for no limit (got {max_tokens})")
    if prompt_cache is not None:
        raise ValueError("prompt_cache= is not supported: mirror-mlx keeps the target's and the draft's caches "
                         "itself and reuses the longest common prefix of successive prompts, so pass the whole "
                         "prompt (the conversation so far) each time instead")
    pipe = pipeline(model, tokenizer, draft_model)
    ids = encode(pipe.tokenizer, prompt) if isinstance(prompt, str) else [int(t) for t in
                                                                          (prompt.tolist() if isinstance(prompt, mx.array) else prompt)]
    if max_tokens == -1:
        max_tokens = max(1, (pipe.engine.context_length or len(ids) + 2 ** 20) - len(ids))
    mode = mode or ("mirror" if draft_model is not None else "ar")
    for chunk in pipe.stream(ids, max_tokens=max_tokens, mode=mode, seed=seed, sampler=sampler,
                             logits_processors=logits_processors or (), max_kv_size=max_kv_size, **knobs):
        last = len(chunk.tokens) - 1
        stats = pipe.stats if chunk.finish_reason else None
        done = chunk.generation_tokens - len(chunk.tokens) - (chunk.stop_token is not None)
        common = dict(logprobs=None, prompt_tokens=chunk.prompt_tokens, prompt_tps=chunk.prompt_tps,
                      generation_tps=chunk.generation_tps, peak_memory=chunk.peak_memory)
        for i, (token, text, drafted) in enumerate(zip(chunk.tokens, chunk.token_texts, chunk.from_draft)):
            final = chunk.finish_reason == "length" and i == last
            yield Response(text=text + (chunk.text[len("".join(chunk.token_texts)):] if final else ""), token=token,
                           from_draft=drafted, generation_tokens=done + i + 1,
                           finish_reason="length" if final else None, stats=stats if final else None, **common)
        if chunk.finish_reason == "stop":  # as mlx-lm: a last record carries the end-of-sequence token
            yield Response(text=chunk.text[len("".join(chunk.token_texts)):], token=chunk.stop_token,
                           from_draft=pipe.stats.from_draft[-1], generation_tokens=chunk.generation_tokens,
                           finish_reason="stop",
                           stats=stats, **common)


def generate(model: nn.Module, tokenizer: Any, prompt: Union[str, List[int]], verbose: bool = False,
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
            print(f"Mirror-SD: {response.stats.summary()}", file=sys.stdout)
    return text


threading._register_atexit(close_all)  # runs before concurrent.futures' own exit hook (they run in reverse)
