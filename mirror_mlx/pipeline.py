"""The public API: `load(model, draft_model)` → `Pipeline.generate / stream / chat`."""

import asyncio
import threading
import weakref
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load_tokenizer

from . import demo_pair, validate
from .ane_draft.host import DraftRecipe, mlx_draft, ss_draft
from .ane_draft.ss_model import is_ss_draft
from .draft_api import Draft
from .engine import Engine, Stats
from .loading import check_same_tokenizer, load_model, resolve_model  # noqa: F401  (resolve_model: API)
from .options import CALLER_OPTIONS, PAPER_KNOBS, DecodeOptions
from .prompt_cache import PromptCache

Prompt = Union[str, Sequence[int]]


@dataclass
class Result:
    """One generation: the text, the generated token ids, and what it cost (see `Stats`)."""

    text: str
    tokens: list[int]
    stats: Stats
    finish_reason: str = "length"  # "stop" when an end-of-sequence token ended it


@dataclass
class Chunk:
    """Text committed by one step (one or more tokens), with mlx-lm's GenerationResponse fields.

    `from_draft[i]` says whether `tokens[i]` was the draft's proposal (accepted), not the target's own
    correction or bonus token. `finish_reason` is None until the last chunk: "stop" (then `stop_token`
    is the end-of-sequence token, which `tokens` leaves out) or "length".
    """

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

    def __str__(self) -> str:
        return self.text


def chunks(steps: Iterator[list[int]], opts: DecodeOptions, tokenizer: Any,
           stats: Callable[[], Stats]) -> Iterator[Chunk]:
    """Engine steps → Chunks: detokenized, end-of-sequence tokens dropped, the last with its finish_reason."""
    detok = tokenizer.detokenizer
    detok.reset()
    produced = 0
    for new in steps:
        produced += len(new)
        s = stats()
        stop = next((t for t in new if t in opts.stop_tokens), None)
        shown = [(t, d) for t, d in zip(new, s.from_draft[produced - len(new) : produced]) if t != stop]
        texts = []
        for t, _ in shown:
            detok.add_token(t)
            texts.append(detok.last_segment)
        finish = "stop" if stop is not None else "length" if produced >= opts.max_tokens else None
        tail = ""
        if finish is not None:
            detok.finalize()
            tail = detok.last_segment
            if texts:
                texts[-1], tail = texts[-1] + tail, ""
        yield Chunk("".join(texts) + tail, [t for t, _ in shown], [d for _, d in shown], finish, stop,
                    s.prompt_tokens, s.prompt_tokens / s.prefill_seconds if s.prefill_seconds else 0.0, produced,
                    produced / s.decode_seconds if s.decode_seconds else 0.0, mx.get_peak_memory() / 1e9, texts)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Text as is (no template), as mlx-lm's stream_generate encodes it: a BOS unless the text has one."""
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos)))


def template_opening(tokenizer: Any, **template_kwargs: Any) -> str:
    """What the chat template puts before a user message's content ("" without a template)."""
    if not getattr(tokenizer, "has_chat_template", False):
        return ""
    marker = "\x00mirror-mlx\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                         tokenize=False, **template_kwargs)
    return text[: text.index(marker)] if marker in text else ""


def load_draft(path: Union[str, Path], target_tokenizer: Any) -> DraftRecipe:
    """How the draft host builds a draft from a folder (plain mlx-lm model or SS draft) or a Core ML package.

    The tokenizer is checked here; the weights are loaded by the host process only.
    """
    path_str = str(path)
    if path_str.endswith(".mlpackage"):
        from mirror_mlx.ane_draft.coreml_draft import coreml_recipe  # raises a clear error off macOS

        return coreml_recipe(Path(path_str), target_tokenizer)
    folder = resolve_model(path)
    check_same_tokenizer(target_tokenizer, load_tokenizer(folder))
    return DraftRecipe(ss_draft if is_ss_draft(folder) else mlx_draft, (str(folder),))


class Pipeline:
    """A target (and optionally a draft) ready to generate in any mode.

    Safe to share between threads: generations run one at a time, each from start to end (a stream
    holds the pipeline until it is exhausted or closed), so each is lossless and seeded as if alone;
    other callers wait. Iterating a stream and starting another generation in the same thread is
    refused (it would wait on itself). After `close()` every call raises ValueError. Shared, read each
    call's own `Result.stats` (`pipe.stats` is whichever generation ran last); `chat` keeps one
    conversation per Pipeline, so give each conversation its own.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, draft: Union[Draft, DraftRecipe, None] = None,
                 exit_adapter: Any = None, name: str = ""):
        self.model = model
        self.tokenizer = tokenizer
        self.draft = draft
        self.name = name
        self.chat_template_kwargs: dict = {}  # e.g. {"enable_thinking": False}, as --chat-template-config
        self.engine = Engine(model, draft, exit_adapter)
        # a Pipeline dropped without close() still stops its draft host and unlinks its shared memory
        self._finalizer = weakref.finalize(self, Engine.close, self.engine)
        self._finalizer.atexit = False  # at exit the hosts' and workers' own atexit hooks stop them
        self.conversation: Any = None  # chat.Conversation: the turns the caches hold (chat.py keeps it)
        self.told_plain = False  # chat.py warned once that the tokenizer has no chat template
        self._lock = threading.Lock()  # one generation at a time (see the class docstring)
        self._owner: Optional[int] = None  # the thread that holds it
        self._closed = False

    @contextmanager
    def _turn(self) -> Iterator[None]:
        """Hold the pipeline for one whole generation."""
        self._check_not_iterating()
        with self._lock:
            self._check_open()
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    def _check_not_iterating(self) -> None:
        if self._owner == threading.get_ident():
            raise ValueError("this thread is still iterating a stream of this Pipeline: exhaust or close() it "
                             "before starting another generation")

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this Pipeline is closed: load() a new one to generate again")

    @property
    def stats(self) -> Stats:
        """Stats of the last generation."""
        return self.engine.stats

    def encode(self, prompt: Prompt) -> list[int]:
        """Ids pass as is. Text goes through the chat template as one user message when the tokenizer has
        one, unless the text already starts with the template's own opening (templated by the caller,
        as mlx-lm's README does): then it is encoded as is, never templated twice."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if not getattr(self.tokenizer, "has_chat_template", False):
            return encode(self.tokenizer, prompt)
        opening = template_opening(self.tokenizer, **self.chat_template_kwargs)
        if opening and prompt.startswith(opening):  # the caller templated it already
            return encode(self.tokenizer, prompt)
        return list(self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                       add_generation_prompt=True, **self.chat_template_kwargs))

    def options(self, stop: bool = True, **kwargs: Any) -> DecodeOptions:
        """`DecodeOptions` from keywords (its fields and defaults are the options); `stop` ends the
        generation at the tokenizer's end-of-sequence tokens. mode="auto" stays auto here: `prepare`
        resolves it (`resolve`)."""
        allowed = list(CALLER_OPTIONS) + ["stop"]
        unknown = sorted(set(kwargs) - set(allowed))
        if unknown:
            raise TypeError(f"unknown option {unknown[0]!r}: the options are {', '.join(allowed)}")
        return DecodeOptions(stop_tokens=tuple(self.tokenizer.eos_token_ids) if stop else (), **kwargs)

    def resolve(self, opts: DecodeOptions) -> DecodeOptions:
        """A concrete mode and knobs: mode="auto" becomes the tuned ones (mirror_mlx.tune.resolve; the first
        call without a profile runs a bounded quick calibration); explicit ones win."""
        from .tune import resolve

        c = resolve(self, opts.mode, opts.kappa, opts.gamma, opts.exit_layer, sampling=opts.sampling)
        return replace(opts, mode=c.mode, kappa=c.kappa, gamma=c.gamma, exit_layer=c.exit_layer, why=opts.why or c.why,
                       tuned=opts.mode == "auto", leave_draft=c.leave_draft)

    def _stand_in(self, opts: DecodeOptions) -> DecodeOptions:
        """What `check` validates before auto is resolved: auto as mirror (ar without a draft), the knobs
        not given as the paper's. Bad input is refused before any calibration starts."""
        mode = opts.mode
        if mode == "auto":
            mode = "mirror" if self.draft is not None else "ar"
        return replace(opts, mode=mode, kappa=PAPER_KNOBS["kappa"] if opts.kappa is None else opts.kappa,
                       gamma=PAPER_KNOBS["gamma"] if opts.gamma is None else opts.gamma)

    def check(self, tokens: Sequence[int], prompt_cache: Optional[PromptCache] = None, **kwargs: Any) -> None:
        """Raise ValueError/TypeError (one sentence) for options or a prompt this pipeline cannot serve."""
        self._check_open()
        opts = self._after_cache(self.options(**kwargs), prompt_cache)
        self.engine.check(self._with_cache(tokens, prompt_cache), self._stand_in(opts), prompt_cache)

    def _with_cache(self, tokens: Sequence[int], prompt_cache: Optional[PromptCache]) -> list[int]:
        """The ids the engine runs: after a loaded prompt cache, its prefix's ids (when known) first."""
        if prompt_cache is None:
            return tokens
        return prompt_cache.prompt(validate.prompt_tokens(tokens, self.engine.vocab_size))

    @staticmethod
    def _after_cache(opts: DecodeOptions, prompt_cache: Optional[PromptCache]) -> DecodeOptions:
        """auto after a prompt cache without token ids (mlx-lm's file) is ar, visibly: the draft needs the ids."""
        if prompt_cache is None or prompt_cache.tokens is not None or opts.mode != "auto":
            return opts
        return replace(opts, mode="ar", why="auto: ar, as the prompt cache holds no token ids for the draft")

    def prepare(self, prompt: Prompt, prompt_cache: Optional[PromptCache] = None,
                **kwargs: Any) -> tuple[list[int], DecodeOptions]:
        """The checked prompt ids and options of one call; refuses bad input before any work starts.

        Text that is not valid UTF-8 (lone surrogates) is decoded with replacement, with one warning.
        With a `prompt_cache` (prompt_cache.read), the prompt is what follows the cached prefix: text is
        then encoded as is, with no template and no BOS (it continues the cached text).
        """
        self._check_open()
        if isinstance(prompt, str):
            text, replaced = validate.clean_text(prompt)
            if replaced:
                warnings.warn(validate.REPLACED, stacklevel=3)
            prompt = (self.encode(text) if prompt_cache is None
                      else self.tokenizer.encode(text, add_special_tokens=False))
        opts = self._after_cache(self.options(**kwargs), prompt_cache)
        prompt, _ = self.engine.check(self._with_cache(prompt, prompt_cache), self._stand_in(opts), prompt_cache)
        if opts.mode == "auto":
            self._check_not_iterating()  # a first auto call calibrates, which needs the pipeline
        return self.engine.check(prompt, self.resolve(opts), prompt_cache)

    def stream(self, prompt: Prompt, prompt_cache: Optional[PromptCache] = None, **kwargs: Any) -> Iterator[Chunk]:
        """Yield text as tokens are committed; `pipe.stats` holds the stats afterwards.

        Bad input raises here, at the call; the pipeline is held from the first chunk until the stream
        is exhausted or closed. `prompt_cache`: a loaded prompt cache file (mirror_mlx.prompt_cache.read)
        that the prompt follows, as mlx_lm.generate --prompt-cache-file.
        """
        tokens, opts = self.prepare(prompt, prompt_cache, **kwargs)

        def held() -> Iterator[Chunk]:
            with self._turn():
                yield from self._chunks(tokens, opts, prompt_cache)

        return held()

    def _chunks(self, tokens: list[int], opts: DecodeOptions,
                prompt_cache: Optional[PromptCache] = None) -> Iterator[Chunk]:
        steps = self.engine.generate(tokens, opts, prompt_cache)
        try:
            yield from chunks(steps, opts, self.tokenizer, lambda: self.engine.stats)
        finally:
            steps.close()

    async def astream(self, prompt: Prompt, **kwargs: Any) -> AsyncIterator[Chunk]:
        """`stream` for async apps: each step runs off the caller's event loop, which keeps running."""
        chunks = self.stream(prompt, **kwargs)
        done = object()
        while (chunk := await asyncio.to_thread(next, chunks, done)) is not done:
            yield chunk

    def generate(self, prompt: Prompt, prompt_cache: Optional[PromptCache] = None, **options: Any) -> Result:
        """Generate up to `max_tokens` tokens; stops early at the tokenizer's end-of-sequence tokens.

        Options are `DecodeOptions` fields (max_tokens, temperature, top_p, top_k, seed, kappa, gamma,
        exit_layer, mode, ...) with its defaults, plus `stop`; `prompt_cache` as for `stream`.
        """
        tokens, opts = self.prepare(prompt, prompt_cache, **options)
        with self._turn():
            parts = list(self._chunks(tokens, opts, prompt_cache))
            stats = self.engine.stats
        tokens = [t for c in parts for t in c.tokens]
        return Result("".join(c.text for c in parts), tokens, stats, parts[-1].finish_reason if parts else "length")

    def chat(self, messages: Sequence[dict], **kwargs: Any) -> Result:
        """The assistant's reply to `messages` (role/content dicts), through the chat template if any.

        Call again with the reply and the next user turn appended: the earlier turns keep their token
        ids, so the caches hold them and only the new turn is prefilled. Options as for `generate`.
        """
        from .chat import chat

        return chat(self, messages, **kwargs)

    def chat_stream(self, messages: Sequence[dict], **kwargs: Any) -> Iterator[Chunk]:
        """`chat`, yielding text as tokens are committed; stopping early keeps what was committed."""
        from .chat import stream_reply

        return stream_reply(self, messages, **kwargs)

    def close(self) -> None:
        """Stop the workers (waits for a generation in flight in another thread); idempotent."""
        if self._owner == threading.get_ident():
            raise ValueError("this thread is still iterating a stream of this Pipeline: exhaust or close() it "
                             "before closing the Pipeline")
        with self._lock:
            if not self._closed:
                self._closed = True
                self._finalizer()  # Engine.close, once


def check_adapter_path(adapter_path: Optional[Union[str, Path]]) -> None:
    if adapter_path is not None and not Path(adapter_path).expanduser().is_dir():
        raise ValueError(f"adapter_path {str(adapter_path)!r} is not a folder: give the folder mlx_lm.lora wrote "
                         "(adapter_config.json + adapters.safetensors)")


def load(model: Optional[Union[str, Path]] = None, draft_model: Optional[Union[str, Path]] = None,
         exit_adapter: Optional[Union[str, Path]] = None, *, adapter_path: Optional[Union[str, Path]] = None,
         tokenizer_config: Optional[dict] = None, trust_remote_code: bool = False) -> Pipeline:
    """Load a target and its draft. With no model, the embedded demo pair (works offline).

    `exit_adapter`: a `mirror-mlx train-exit` file that sharpens the early exit (never the target's
    own logits). The demo pair loads its shipped layer-2 adapter unless `exit_adapter="none"`.
    `adapter_path`, `tokenizer_config`, `trust_remote_code`: as mlx_lm.load (LoRA adapters apply to the
    target; an exit adapter is then trained on the adapted target). Any other keyword is a TypeError.
    """
    if model is None:
        model = demo_pair.TARGET
        draft_model = demo_pair.DRAFT if draft_model is None else draft_model
        exit_adapter = demo_pair.EXIT_ADAPTER if exit_adapter is None else exit_adapter
    if str(exit_adapter).lower() == "none":  # the demo's shipped adapter, turned off
        exit_adapter = None
    check_adapter_path(adapter_path)
    tokenizer_config = dict(tokenizer_config or {}, trust_remote_code=trust_remote_code)
    target, tokenizer = load_model(model, tokenizer_config=tokenizer_config, trust_remote_code=trust_remote_code,
                                   adapter_path=None if adapter_path is None else str(adapter_path))
    mx.eval(target.parameters())  # LoRA layers come lazy; the target's thread cannot evaluate this thread's graph
    draft = load_draft(draft_model, tokenizer) if draft_model is not None else None
    adapter = None
    if exit_adapter is not None:
        from .exit_adapter import load_adapters

        adapter = load_adapters(exit_adapter, target)  # several, comma-separated: one per exit layer
    return Pipeline(target, tokenizer, draft, adapter, name=str(model))
