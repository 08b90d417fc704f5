"""The public API: `load(model, draft_model)` → `Pipeline.generate / stream / chat`.

One way in: each call's text becomes ids here (mirror_mlx.text), its prompt and options are checked
once (`prepare`), mode auto is resolved (mirror_mlx.tune.policy), and the engine, which trusts what it
is given, yields a `Step` per step that becomes a `Chunk` of text.
"""

import asyncio
import threading
import weakref
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from . import demo_pair, text, validate
from .drafts.recipes import DraftRecipe, mlx_draft, ss_draft
from .drafts.ss_model import is_ss_draft
from .draft_api import Draft
from .chunks import Chunk, Detokenizer, Result, kept as _kept, result
from .engine import Engine
from .stats import Stats
from .draft_tokenizer import check_draft_tokenizer, folder_tokenizer
from .loading import load_model, resolve_model
from .lookup import LOOKUP, NGRAM_MIN
from .options import CALLER_OPTIONS, PAPER_KNOBS, DecodeOptions
from .prompt_cache import PromptCache
from .text import Conversation, Message
from .tune.placement import placed
from .tune.profile import row_cost
from .tune.policy import AutoRun, AutoState, Pair, explicit, lookup_alone, needs_knobs, profile_for, resolve

if TYPE_CHECKING:
    from .tune.profile import Profile

Prompt = Union[str, Sequence[int]]
NO_TEMPLATE = "the model has no chat template: each turn continues the text (plain continuation)"


def load_draft(path: Union[str, Path], target_tokenizer: Any) -> DraftRecipe:
    """How the draft host builds a draft from a folder (plain mlx-lm model or SS draft) or a Core ML package.

    The tokenizer is checked here; the weights are loaded by the host process only.
    """
    path_str = str(path)
    if path_str.endswith(".mlpackage"):
        from mirror_mlx.ane_draft.coreml_draft import coreml_recipe  # raises a clear error off macOS

        return coreml_recipe(Path(path_str), target_tokenizer)
    folder = resolve_model(path)
    check_draft_tokenizer(target_tokenizer, folder_tokenizer(folder), folder)
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
                 exit_adapter: Any = None, name: str = "", lookup_only: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.draft = draft
        self.lookup_only = lookup_only  # draft_model="lookup": the prompt lookup drafts, no draft model
        self.name = name
        self.chat_template_kwargs: dict = {}  # e.g. {"enable_thinking": False}, as --chat-template-config
        self.engine = Engine(model, draft, exit_adapter, lookup_only)
        # a Pipeline dropped without close() still stops its draft host and unlinks its shared memory
        self._finalizer = weakref.finalize(self, Engine.close, self.engine)
        self._finalizer.atexit = False  # at exit the hosts' and workers' own atexit hooks stop them
        self._auto: Optional[AutoState] = None
        self.conversation = Conversation()  # the turns the caches hold (`chat`)
        self.stats = Stats()  # the last generation's
        self.lock = threading.Lock()  # one generation at a time (see the class docstring); tune holds it too
        self._owner: Optional[int] = None  # the thread that holds it
        self._closed = False
        self._told_plain = False  # `chat` warned once that the tokenizer has no chat template

    @property
    def auto(self) -> AutoState:
        """Mode auto's profile and what its runs have seen (mirror_mlx.tune.policy), made on first use."""
        if self._auto is None:
            self._auto = AutoState()
        return self._auto

    def profile(self, asking: str = "auto") -> "Profile":
        """The pair's profile: in memory, else on disk, else a quick calibration on this first call (its line
        names the mode `asking` for it)."""
        return profile_for(self, asking)

    def pair(self) -> Pair:
        """What mode resolution needs to know of this pair (tune.policy.resolve)."""
        return Pair(self.draft is not None, self.engine.exit_layer(DecodeOptions()))

    @property
    def context_length(self) -> Optional[int]:
        """The target's context in tokens (None when its config does not say)."""
        return self.engine.context_length

    @contextmanager
    def _turn(self) -> Iterator[None]:
        """Hold the pipeline for one whole generation."""
        self._check_not_iterating()
        with self.lock:
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

    def encode(self, prompt: Prompt) -> list[int]:
        """Ids pass as is; text as `text.api_prompt` (through the chat template unless already templated)."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        return text.api_prompt(self.tokenizer, prompt, self.chat_template_kwargs)

    def options(self, stop: bool = True, **kwargs: Any) -> DecodeOptions:
        """`DecodeOptions` from keywords (its fields and defaults are the options); `stop` ends the
        generation at the tokenizer's end-of-sequence tokens. mode="auto" stays auto here: `prepare`
        resolves it."""
        allowed = list(CALLER_OPTIONS) + ["stop"]
        unknown = sorted(set(kwargs) - set(allowed))
        if unknown:
            raise TypeError(f"unknown option {unknown[0]!r}: the options are {', '.join(allowed)}")
        return DecodeOptions(stop_tokens=tuple(self.tokenizer.eos_token_ids) if stop else (), **kwargs)

    def _stand_in(self, opts: DecodeOptions) -> DecodeOptions:
        """What is checked before auto is resolved: auto as mirror (without a draft model: sd with the lookup,
        else ar), the knobs not given as the paper's. Bad input is refused before any calibration starts."""
        mode = opts.mode
        if mode == "auto":
            lookup = opts.lookup or (opts.lookup is None and self.lookup_only)
            mode = "mirror" if self.draft is not None else "sd" if lookup else "ar"
        return replace(opts, mode=mode, kappa=PAPER_KNOBS["kappa"] if opts.kappa is None else opts.kappa,
                       gamma=PAPER_KNOBS["gamma"] if opts.gamma is None else opts.gamma)

    def check(self, tokens: Sequence[int], prompt_cache: Optional[PromptCache] = None, **kwargs: Any) -> "Admitted":
        """Raise ValueError/TypeError (one sentence) for options or a prompt this pipeline cannot serve
        (say, a server's or a chat's defaults, before the first request). What passed, handed to `stream`
        with the same prompt and options (a server's request), is not checked again."""
        self._check_open()
        opts = self._after_cache(self.options(**kwargs), prompt_cache)
        return self._admit(tokens, opts, prompt_cache)

    def _admit(self, tokens: Sequence[int], opts: DecodeOptions, prompt_cache: Optional[PromptCache],
               admitted: Optional["Admitted"] = None) -> "Admitted":
        """The engine's check of the call (its stand-in options, before auto is resolved), run once per request:
        `admitted`, an earlier check of the same prompt ids and options (no prompt cache), is taken as it is."""
        stand_in = self._stand_in(opts)
        if admitted is not None and prompt_cache is None and admitted.covers(tokens, stand_in):
            return admitted
        ids, checked = self.engine.check(self._with_cache(tokens, prompt_cache), stand_in, prompt_cache)
        return Admitted(stand_in, ids, checked)

    def _with_cache(self, tokens: Sequence[int], prompt_cache: Optional[PromptCache]) -> Sequence[int]:
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

    def prepare(self, prompt: Prompt, prompt_cache: Optional[PromptCache] = None, admitted: Optional["Admitted"] = None,
                **kwargs: Any) -> tuple[list[int], DecodeOptions, Optional[AutoRun]]:
        """The call's prompt ids and options, checked once (before any work starts; `admitted`: what `check`
        returned for the same prompt and options), mode auto resolved (with its watch over the generation, else
        None). Knobs from the pair's profile come from its own grid and are trusted, as auto's are.

        Text that is not valid UTF-8 (lone surrogates) is decoded with replacement, with one warning.
        With a `prompt_cache` (prompt_cache.read), the prompt is what follows the cached prefix: text is
        then encoded as is, with no template and no BOS (it continues the cached text).
        """
        self._check_open()
        if isinstance(prompt, str):
            clean, replaced = validate.clean_text(prompt)
            if replaced:
                warnings.warn(validate.REPLACED, stacklevel=3)
            prompt = self.encode(clean) if prompt_cache is None else text.after_cache(self.tokenizer, clean)
        opts = self._after_cache(self.options(**kwargs), prompt_cache)
        ids, checked = self._admit(prompt, opts, prompt_cache, admitted).checked
        if self.draft is None and checked.mode == "sd" and checked.lookup:  # the lookup alone: nothing to calibrate
            return ids, lookup_alone(checked, opts.mode, opts.gamma), None
        if opts.mode != "auto" and not needs_knobs(opts.mode, opts.kappa, opts.gamma):
            return ids, replace(checked, why=checked.why or f"mode {opts.mode} as asked"), None
        if opts.mode != "auto":  # the knobs left out come from the pair's profile (tune.policy.explicit)
            self._check_not_iterating()  # a first call may calibrate, which needs the pipeline
            c = explicit(self.profile, self.pair(), opts.mode, opts.kappa, opts.gamma, opts.exit_layer)
            picked = replace(checked, kappa=c.kappa, gamma=c.gamma, exit_layer=c.exit_layer, why=checked.why or c.why,
                             branches=checked.branches if checked.branches is not None else c.branches)
            if picked.mode == "mirror" and opts.branches is not None:  # the caller's B against the picked κ, γ
                validate.branch_budget(picked.branches, picked.kappa, picked.gamma)
            return ids, picked, None
        self._check_not_iterating()  # a first auto call calibrates, which needs the pipeline
        given = replace(checked, mode="auto", kappa=None if opts.kappa is None else checked.kappa,
                        gamma=None if opts.gamma is None else checked.gamma)
        resolved, run = resolve(given, self.profile, self.auto, self.pair())  # this pair's own runs: trusted
        if resolved.mode == "ar" and resolved.lookup and opts.ngram_min is None:  # the lookup beside the target
            resolved = replace(resolved, ngram_min=min(NGRAM_MIN, resolved.ngram_max))  # alone: its n as alone
        return ids, resolved, run

    def stream(self, prompt: Prompt, prompt_cache: Optional[PromptCache] = None,
               detokenizer: Optional[Detokenizer] = None, admitted: Optional["Admitted"] = None,
               **kwargs: Any) -> Iterator[Chunk]:
        """Yield text as tokens are committed; `pipe.stats` holds the stats afterwards.

        Bad input raises here, at the call; the pipeline is held from the first chunk until the stream
        is exhausted or closed. `prompt_cache`: a loaded prompt cache file (mirror_mlx.prompt_cache.read)
        that the prompt follows, as mlx_lm.generate --prompt-cache-file. `detokenizer`: one that goes on
        from earlier tokens (a server's request that resumes), else a fresh one. `admitted`: what `check`
        returned for this prompt and these options (a server's request, checked when it came in).
        """
        tokens, opts, run = self.prepare(prompt, prompt_cache, admitted, **kwargs)
        return self._chunks(tokens, opts, run, prompt_cache, hold=True, detokenizer=detokenizer)

    def _chunks(self, tokens: list[int], opts: DecodeOptions, run: Optional[AutoRun],
                prompt_cache: Optional[PromptCache] = None, hold: bool = False,
                detokenizer: Optional[Detokenizer] = None) -> Iterator[Chunk]:
        """The engine's steps as Chunks; `hold`: hold the pipeline from the first chunk to the last (else
        the caller holds it). `stats` is the sum of this generation's step records so far."""
        if opts.lookup and opts.row_cost is None:  # the lookup weighs its windows at the pair's measured verify
            opts = replace(opts, row_cost=row_cost(self._auto.profile if self._auto is not None else None))
        with self._turn() if hold else nullcontext(), placed(self, opts) as opts:  # cores: tune/placement.py
            steps = self.engine.generate(tokens, opts, prompt_cache, leave_draft=run)
            detok = detokenizer or Detokenizer(self.tokenizer, opts.max_tokens, opts.stop_tokens)
            self.stats = Stats(mode=opts.mode)
            try:
                for step in steps:
                    self.stats = self.stats + step.stats
                    yield detok.chunk(step, self.stats)
            finally:
                steps.close()
                if run is not None:
                    run.done(self.stats)

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
        tokens, opts, run = self.prepare(prompt, prompt_cache, **options)
        with self._turn():
            parts = [_kept(c) for c in self._chunks(tokens, opts, run, prompt_cache)]
            stats = self.stats
        return result(parts, stats, parts[-1].finish_reason if parts else "length")

    # --- chat -------------------------------------------------------------------------------------

    def chat_ids(self, messages: Sequence[Message]) -> list[int]:
        """The ids `chat` runs for `messages` plus the assistant's turn (text.conversation): the earlier
        turns keep the ids the caches hold."""
        return text.conversation(self.tokenizer, self.conversation, messages, self.chat_template_kwargs)

    def chat_stream(self, messages: Sequence[Message], *, ids: Optional[list[int]] = None,
                    **kwargs: Any) -> Iterator[Chunk]:
        """`chat`, yielding text as tokens are committed; stopping early keeps what was committed.
        Bad input raises here, at the call, and leaves the conversation as it was. `ids`: what
        `chat_ids(messages)` returned, when the caller needed them first (a server's context check)."""
        self._check_open()
        messages = [text.clean_message(m) for m in messages]
        if not messages:
            raise ValueError("the conversation is empty: give at least one message")
        tokens, opts, run = self.prepare(self.chat_ids(messages) if ids is None else ids, **kwargs)
        return self._reply(messages, tokens, opts, run)

    def _reply(self, messages: list[Message], tokens: list[int], opts: DecodeOptions,
               run: Optional[AutoRun]) -> Iterator[Chunk]:
        committed: list[int] = []
        said: list[str] = []
        stop: Optional[int] = None
        with self._turn():  # the pipeline is held for the whole reply
            try:
                for chunk in self._chunks(tokens, opts, run):
                    committed += chunk.tokens + ([chunk.stop_token] if chunk.stop_token is not None else [])
                    stop = chunk.stop_token
                    said.append(chunk.text)
                    yield chunk
            finally:  # whatever was committed is remembered, also when the caller stops early (Ctrl-C)
                reply = {"role": "assistant", "content": "".join(said)}
                self.conversation = Conversation(messages + [reply], tokens + committed, stop)

    def chat(self, messages: Sequence[Message], **kwargs: Any) -> Result:
        """The assistant's reply to `messages` (role/content dicts), through the chat template if any.

        Call again with the reply and the next user turn appended: the earlier turns keep their token
        ids, so the caches hold them and only the new turn is prefilled. Options as for `generate`.
        """
        if not text.has_chat_template(self.tokenizer) and not self._told_plain:
            self._told_plain = True
            warnings.warn(NO_TEMPLATE, stacklevel=2)
        parts = [_kept(c) for c in self.chat_stream(messages, **kwargs)]
        return result(parts, self.stats, "stop" if self.conversation.stop_token is not None else "length")

    def reset(self) -> None:
        """Forget the conversation and clear both caches (the next turn prefills from scratch)."""
        self.conversation = Conversation()
        self.engine.reset()

    def close(self) -> None:
        """Stop the workers (waits for a generation in flight in another thread); idempotent."""
        if self._owner == threading.get_ident():
            raise ValueError("this thread is still iterating a stream of this Pipeline: exhaust or close() it "
                             "before closing the Pipeline")
        with self.lock:
            if not self._closed:
                self._closed = True
                self._finalizer()  # Engine.close, once


@dataclass(frozen=True)
class Admitted:
    """A prompt and options that passed the engine's check (`Pipeline.check`): the options checked (auto as its
    stand-in) and what the engine will run (`checked`)."""

    stand_in: DecodeOptions
    ids: list[int]
    opts: DecodeOptions

    @property
    def checked(self) -> tuple[list[int], DecodeOptions]:
        return self.ids, self.opts

    def covers(self, tokens: Sequence[int], stand_in: DecodeOptions) -> bool:
        """Whether this check was of the same prompt ids and options (else the call is checked anew)."""
        return self.stand_in == stand_in and isinstance(tokens, list) and self.ids == tokens


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
    lookup_only = str(draft_model) == LOOKUP
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
    draft = load_draft(draft_model, tokenizer) if draft_model is not None and not lookup_only else None
    adapter = None
    if exit_adapter is not None:
        from .exit_adapter import load_adapters

        adapter = load_adapters(exit_adapter, target)  # several, comma-separated: one per exit layer
    return Pipeline(target, tokenizer, draft, adapter, name=str(model), lookup_only=lookup_only)
