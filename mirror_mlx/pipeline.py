"""The public API: `load(model, draft_model)` → `Pipeline.generate / stream / chat`.

One way in: each call's text becomes ids here (mirror_mlx.text), its prompt and options are checked
once into a `Plan` (`plan`, validate.request), mode auto is resolved (`resolve`: mirror_mlx.tune.policy), and the
engine, which trusts what it is given, yields a `Step` per step that becomes a `Chunk` of text.
"""

import asyncio
import threading
import weakref
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Generator, Iterator, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load_config

from mirror_mlx.ane_draft.coreml_draft import coreml_recipe

from . import demo as demo_pair, text, validate
from .drafts.recipes import DraftRecipe, mlx_draft, ss_draft
from .drafts.distilled.model import MODEL_TYPE as DISTILLED
from .drafts.ss.model import is_ss_draft
from .drafts.vocab import kept_ids
from .drafts.api import Draft
from .chunks import Chunk, Detokenizer, Result, kept as _kept, result
from .engine import Engine
from .engine.stats import Stats
from .drafts.tokenizer import check_draft_tokenizer, folder_tokenizer
from .engine.exit_adapter import load_adapters
from .loading import load_model, resolve_model
from .proposers.proposing import Proposing
from .proposers.recycle import RECYCLE, Recycled
from .options import CALLER_OPTIONS, DecodeOptions, Plan
from .prompt_cache import PromptCache
from .text import Conversation, ChatMessage
from .tune.placement import placed
from .tune.policy import AutoState, PairFacts, profile_for, resolve
from .tune.profile import Profile, row_cost

if TYPE_CHECKING:
    from .engine.exit_adapter import ExitAdapter, ExitAdapters
    from mlx_lm.tokenizer_utils import TokenizerWrapper

PromptInput = Union[str, Sequence[int]]
NO_TEMPLATE = "the model has no chat template: each turn continues the text (plain continuation)"


def load_draft(path: Union[str, Path], target_tokenizer: "TokenizerWrapper",
               draft_vocab: Optional[int] = None) -> DraftRecipe:
    """How the draft host builds a draft from a folder (plain mlx-lm model or SS draft) or a Core ML package;
    `draft_vocab`: its head scores only that many ids. The tokenizer is checked here, the weights loaded by
    the host process only."""
    path_str = str(path)
    if path_str.endswith(".mlpackage"):
        if draft_vocab is not None:
            raise validate.BadValue("draft_vocab", "{draft_vocab} trims an MLX draft's head, and a Core ML package's "
                                    "head is fixed when it is converted: leave {draft_vocab} out")
        return coreml_recipe(Path(path_str), target_tokenizer)
    folder = resolve_model(path)
    tokenizer = folder_tokenizer(folder)
    check_draft_tokenizer(target_tokenizer, tokenizer, folder)
    kept = () if draft_vocab is None else trimmed_head(folder, tokenizer, draft_vocab)
    return DraftRecipe(ss_draft if is_ss_draft(folder) else mlx_draft, (str(folder),) + kept)


def trimmed_head(folder: Path, tokenizer: "TokenizerWrapper", size: Optional[int]) -> tuple:
    """The recipe's argument for `draft_vocab` = `size`: the kept ids, or none when `size` is the whole vocabulary
    (the head is then left whole, as without draft_vocab)."""
    config = load_config(folder)
    if config.get("model_type") == DISTILLED:
        raise validate.BadValue("draft_vocab", "{draft_vocab}: this draft (mirror-mlx distill) already scores only "
                                "its {n} kept ids; leave {draft_vocab} out", n=config.get("kept_size"))
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or len(tokenizer.get_vocab())
    size = validate.draft_vocab(size, True, vocab)
    return () if size is None or size == vocab else (kept_ids(tokenizer, size, vocab),)


class Pipeline:
    """A target (and optionally a draft) ready to generate in any mode.

    Safe to share between threads: generations run one at a time, start to end (a stream holds the pipeline
    until exhausted or closed), each lossless and seeded as if alone. Starting another generation while this
    thread iterates a stream is refused (it would wait on itself); after `close()` every call raises
    ValueError. Shared, read each call's own `Result.stats`; `chat` keeps one conversation per Pipeline.
    """

    def __init__(self, model: nn.Module, tokenizer: "TokenizerWrapper", draft: Union[Draft, DraftRecipe, None] = None,
                 exit_adapter: "Union[ExitAdapter, ExitAdapters, None]" = None, name: str = "",
                 draftless: Optional[str] = None):
        self.model = model
        self.tokenizer = tokenizer
        self.draft = draft
        self.name = name
        self.chat_template_kwargs: dict = {}  # e.g. {"enable_thinking": False}, as --chat-template-config
        # `draftless`: "lookup" or "recycle", no draft model (mirror_mlx/proposers/lookup.py, recycle.py)
        self.engine = Engine(model, draft, exit_adapter, Proposing.name_of(draftless))
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

    def profile(self, asking: str = "auto", temperature: float = 0.0) -> "Profile":
        """The pair's profile: in memory, else on disk, else a quick calibration on this first call, at its
        `temperature` (its line names the mode `asking` for it)."""
        return profile_for(self, asking, temperature)

    @property
    def proposing(self) -> Proposing:
        """What this pair proposes with (a draft model, the lookup alone, the recycled draft): which mode and
        proposer a call runs is asked of it."""
        return self.engine.proposing

    @property
    def recycled(self) -> Optional[Recycled]:
        """The recycled draft's table (draft_model="recycle", or once auto ran the tree), else None: the server's
        batch learns in it too."""
        return self.engine.recycled

    def facts(self) -> PairFacts:
        """What mode resolution needs to know of this pair (tune.policy.resolve)."""
        return PairFacts(self.draft is not None, self.engine.exit_layer(DecodeOptions()), self.proposing)

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

    def _check_not_iterating(self, before: str = "starting another generation") -> None:
        if self._owner == threading.get_ident():
            raise ValueError(f"this thread is still iterating a stream of this Pipeline: exhaust or close() it "
                             f"before {before}")

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this Pipeline is closed: load() a new one to generate again")

    def encode(self, prompt: PromptInput) -> list[int]:
        """A user message's ids: ids pass as is; text as `text.api_prompt` (through the chat template unless
        already templated), as tune and bench encode their prompt sets. `generate` and `stream` do not: text is
        theirs as is, as mlx-lm's generate takes a string."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        return text.api_prompt(self.tokenizer, prompt, self.chat_template_kwargs)

    def options(self, stop: bool = True, **kwargs: Any) -> DecodeOptions:
        """`DecodeOptions` from keywords (its fields and defaults are the options); `stop` ends the
        generation at the tokenizer's end-of-sequence tokens. mode="auto" stays auto here: `resolve`
        resolves it."""
        allowed = list(CALLER_OPTIONS) + ["stop"]
        unknown = sorted(set(kwargs) - set(allowed))
        if unknown:
            raise TypeError(f"unknown option {unknown[0]!r}: the options are {', '.join(allowed)}")
        return DecodeOptions(stop_tokens=tuple(self.tokenizer.eos_token_ids) if stop else (), **kwargs)

    def check(self, tokens: Sequence[int], prompt_cache: Optional[PromptCache] = None, cap: bool = False,
              **kwargs: Any) -> Plan:
        """The call as a `Plan`, its ids and options checked once, before any work starts (validate.BadOption
        names the option at fault). `cap`: max_tokens is a ceiling, lowered to what the context leaves."""
        self._check_open()
        opts = self.options(**kwargs)
        if prompt_cache is not None and prompt_cache.tokens is None and opts.mode == "auto":
            opts = replace(opts, mode="ar", why="auto: ar, as the prompt cache holds no token ids for the draft")
        return validate.request(self.engine, tokens, opts, prompt_cache, cap)

    def plan(self, prompt: PromptInput, prompt_cache: Optional[PromptCache] = None, cap: bool = False,
             **kwargs: Any) -> Plan:
        """`check` of a prompt given as text (invalid UTF-8 replaced, with one warning) or ids. Text is encoded as
        is, as mlx-lm's generate encodes a string: no chat template (`chat` takes messages through it), a BOS
        unless the text has one; after a `prompt_cache`'s prefix, no BOS either."""
        self._check_open()
        if isinstance(prompt, str):
            clean, replaced = validate.clean_text(prompt)
            if replaced:
                warnings.warn(validate.REPLACED, stacklevel=3)
            prompt = (text.as_is if prompt_cache is None else text.after_cache)(self.tokenizer, clean)
        return self.check(prompt, prompt_cache, cap, **kwargs)

    def resolve(self, plan: Plan) -> Plan:
        """The plan with its mode and knobs concrete (tune.policy.resolve: explicit ones win, the rest from the
        pair's profile, which a first call may calibrate), its proposer named, and auto's watch over the run."""
        if plan.resolved:
            return plan
        self._check_not_iterating()
        opts, run = resolve(plan.asked, plan.opts, self.profile, self.auto, self.facts())
        # named once, for the engine: auto's choice of the recycled tree names it already
        kind = opts.proposer or self.auto.proposer_forced or self.proposing.kind(opts.mode, opts.lookup)
        opts = replace(opts, proposer=kind)
        # windows, trees: at the measured verify
        if (opts.lookup or kind == RECYCLE) and opts.row_cost is None:
            opts = replace(opts, row_cost=row_cost(self.auto.profile))
        return replace(plan, opts=opts, run=run, resolved=True)

    def stream(self, prompt: PromptInput, prompt_cache: Optional[PromptCache] = None,
               **kwargs: Any) -> Generator[Chunk, None, None]:
        """Yield text as tokens are committed; `pipe.stats` holds the stats afterwards. Bad input raises here, at
        the call; the pipeline is held from the first chunk until the stream is exhausted or closed.
        `prompt_cache`: a prompt cache file (prompt_cache.read) the prompt follows, as mlx_lm.generate's."""
        return self.run(self.plan(prompt, prompt_cache, **kwargs))

    def run(self, plan: Plan, detokenizer: Optional[Detokenizer] = None) -> Generator[Chunk, None, None]:
        """`stream` of a checked plan (a server's request); `detokenizer`: one going on from earlier tokens."""
        return self._chunks(self.resolve(plan), hold=True, detokenizer=detokenizer)

    def _chunks(self, plan: Plan, hold: bool = False,
                detokenizer: Optional[Detokenizer] = None) -> Generator[Chunk, None, None]:
        """The engine's steps as Chunks (`stats`: their sum so far); `hold`: hold the pipeline meanwhile."""
        with self._turn() if hold else nullcontext(), placed(self, plan.opts) as opts:  # cores: tune/placement.py
            steps = self.engine.generate(plan.ids, opts, plan.prompt_cache, leave_draft=plan.run)
            detok = detokenizer or Detokenizer(self.tokenizer, opts.max_tokens, opts.stop_tokens)
            self.stats = Stats(mode=opts.mode)
            try:
                for step in steps:
                    self.stats = self.stats + step.stats
                    yield detok.chunk(step, self.stats)
            finally:
                steps.close()
                if plan.run is not None:
                    plan.run.done(self.stats)

    async def astream(self, prompt: PromptInput, **kwargs: Any) -> AsyncIterator[Chunk]:
        """`stream` for async apps: each step runs off the caller's event loop, which keeps running."""
        chunks = self.stream(prompt, **kwargs)
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            yield chunk

    def generate(self, prompt: PromptInput, prompt_cache: Optional[PromptCache] = None, **options: Any) -> Result:
        """Generate up to `max_tokens` tokens; stops early at the tokenizer's end-of-sequence tokens. Text is
        encoded as is, as mirror_mlx.generate and mlx-lm's generate take it (no chat template: see `chat`).

        Options are `DecodeOptions` fields (max_tokens, temperature, top_p, top_k, seed, kappa, gamma,
        exit_layer, mode, ...) with its defaults, plus `stop`; `prompt_cache` as for `stream`.
        """
        plan = self.resolve(self.plan(prompt, prompt_cache, **options))
        with self._turn():
            parts = [_kept(c) for c in self._chunks(plan)]
            stats = self.stats
        return result(parts, stats, (parts[-1].finish_reason if parts else None) or "length")

    # --- chat -------------------------------------------------------------------------------------

    def chat_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The ids `chat` runs for `messages` plus the assistant's turn (earlier turns keep the cached ids)."""
        return text.conversation(self.tokenizer, self.conversation, messages, self.chat_template_kwargs)

    def chat_stream(self, messages: Sequence[ChatMessage], *, plan: Optional[Plan] = None,
                    **kwargs: Any) -> Generator[Chunk, None, None]:
        """`chat`, yielding text as tokens are committed; stopping early keeps what was committed. Bad input
        raises here and leaves the conversation as it was. `plan`: the turn already checked (`chat_ids`)."""
        self._check_open()
        messages = [text.clean_message(m) for m in messages]
        if not messages:
            raise ValueError("the conversation is empty: give at least one message")
        plan = self.resolve(plan or self.check(self.chat_ids(messages), **kwargs))
        return self._reply(messages, plan)

    def _reply(self, messages: list[ChatMessage], plan: Plan) -> Generator[Chunk, None, None]:
        committed, said, stop = [], [], None  # the reply's tokens, its texts, the end-of-sequence token
        with self._turn():  # the pipeline is held for the whole reply
            try:
                for chunk in self._chunks(plan):
                    committed += chunk.committed
                    stop = chunk.stop_token
                    said.append(chunk.text)
                    yield chunk
            finally:  # whatever was committed is remembered, also when the caller stops early (Ctrl-C)
                reply = {"role": "assistant", "content": "".join(said)}
                self.conversation = Conversation(messages + [reply], plan.ids + committed, stop)

    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Result:
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
        self._check_not_iterating("closing the Pipeline")
        with self.lock:
            if not self._closed:
                self._closed = True
                self._finalizer()  # Engine.close, once


def check_adapter_path(adapter_path: Optional[Union[str, Path]]) -> None:
    if adapter_path is not None and not Path(adapter_path).expanduser().is_dir():
        raise validate.BadValue("adapter_path", "{adapter_path} {path!r} is not a folder: give the folder "
                                "mlx_lm.lora wrote (adapter_config.json + adapters.safetensors)",
                                path=str(adapter_path))


def load(model: Optional[Union[str, Path]] = None, draft_model: Optional[Union[str, Path]] = None,
         exit_adapter: Optional[Union[str, Path]] = None, *, adapter_path: Optional[Union[str, Path]] = None,
         tokenizer_config: Optional[dict] = None, trust_remote_code: bool = False,
         draft_vocab: Optional[int] = None) -> Pipeline:
    """Load a target and its draft. With no model, the embedded demo pair (works offline).

    `exit_adapter`: a `mirror-mlx train-exit` file that sharpens the early exit (never the target's
    own logits). The demo pair loads its shipped layer-2 adapter unless `exit_adapter="none"`.
    `adapter_path`, `tokenizer_config`, `trust_remote_code`: as mlx_lm.load (LoRA adapters apply to the
    target; an exit adapter is then trained on the adapted target). `draft_vocab`: the draft's head scores only
    the V ids most frequent in the shipped text (mirror_mlx/drafts/vocab.py; lossless: the target verifies every
    token); V from 1 to the draft's vocabulary, which keeps the whole head. Any other keyword is a TypeError.
    """
    draftless = Proposing.name_of(draft_model)  # "lookup" or "recycle": no draft model to load
    if model is None:
        model = demo_pair.TARGET
        draft_model = demo_pair.DRAFT if draft_model is None else draft_model
        exit_adapter = demo_pair.EXIT_ADAPTER if exit_adapter is None else exit_adapter
    validate.draft_vocab(draft_vocab, draft_model is not None and not draftless)  # before any loading
    if str(exit_adapter).lower() == "none":  # the demo's shipped adapter, turned off
        exit_adapter = None
    check_adapter_path(adapter_path)
    tokenizer_config = dict(tokenizer_config or {}, trust_remote_code=trust_remote_code)
    target, tokenizer = load_model(model, tokenizer_config=tokenizer_config, trust_remote_code=trust_remote_code,
                                   adapter_path=None if adapter_path is None else str(adapter_path))
    mx.eval(target.parameters())  # LoRA layers come lazy; the target's thread cannot evaluate this thread's graph
    draft = load_draft(draft_model, tokenizer, draft_vocab) if draft_model is not None and not draftless else None
    adapter = None
    if exit_adapter is not None:
        adapter = load_adapters(exit_adapter, target)  # several, comma-separated: one per exit layer
    return Pipeline(target, tokenizer, draft, adapter, name=str(model), draftless=draftless)
