"""The public API: `load(model, draft_model)` → `Pipeline.generate / stream / chat`."""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import mlx.nn as nn
from mlx_lm.utils import load as mlx_load

from .draft import MLXDraft
from .draft_api import Draft
from .engine import DecodeOptions, Engine, Stats

DEMO_DIR = Path(__file__).resolve().parent / "demo"
DEMO_TARGET = DEMO_DIR / "stories260K"
DEMO_DRAFT = DEMO_DIR / "llama2xs"
DEMO_EXIT_ADAPTER = DEMO_DIR / "stories260K_exit2.safetensors"  # mirror-mlx train-exit --exit-layer 2

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
    """Text committed by one step (one or more tokens)."""

    text: str
    tokens: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        return self.text


def resolve_model(path_or_id: Union[str, Path]) -> Path:
    """A local folder as is; otherwise a Hugging Face id through huggingface_hub (cached, offline-friendly)."""
    path = Path(path_or_id).expanduser()
    if path.exists():
        return path
    name = str(path_or_id)
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ValueError(f"model path {name!r} does not exist: give a model folder or a Hugging Face id like org/name")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.py", "*.model",
                                                            "*.tiktoken", "*.txt", "*.jinja"]))
    except Exception as e:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        raise ValueError(
            f"model {name!r} is not a local folder and could not be fetched from the Hugging Face hub"
            f"{' (HF_HUB_OFFLINE=1)' if offline else ''}: {type(e).__name__}. Download it once with network "
            f"(`hf download {name}`) or pass a local folder"
        ) from None


def check_same_tokenizer(target_tok: Any, draft_tok: Any) -> None:
    """Target and draft must map the same strings to the same ids, or verification compares nonsense."""
    tv, dv = target_tok.vocab_size, draft_tok.vocab_size
    if tv != dv:
        raise ValueError(f"the draft's tokenizer has {dv} tokens but the target's has {tv}: "
                         "use a draft trained with the target's tokenizer")
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if t_vocab != d_vocab:
        diff = next(k for k in t_vocab if d_vocab.get(k) != t_vocab[k])
        raise ValueError(f"target and draft tokenizers differ (token {diff!r} is {t_vocab[diff]} in the target, "
                         f"{d_vocab.get(diff)} in the draft): use a draft trained with the target's tokenizer")


def load_draft(path: Union[str, Path], target_tokenizer: Any) -> Draft:
    """A draft from a folder (plain mlx-lm model or SS draft) or a Core ML package."""
    path_str = str(path)
    if path_str.endswith(".mlpackage"):
        from mirror_mlx.ane_draft.coreml_draft import CoreMLDraft  # raises a clear error off macOS

        return CoreMLDraft(Path(path_str), target_tokenizer)
    folder = resolve_model(path)
    try:
        from mirror_mlx.ane_draft.ss_draft import SSDraft, is_ss_draft, load_ss_draft
    except ImportError:  # the SS draft module is optional at this layer
        is_ss_draft = None
    if is_ss_draft is not None and is_ss_draft(folder):
        model, tokenizer = load_ss_draft(folder)
        check_same_tokenizer(target_tokenizer, tokenizer)
        return SSDraft(model)
    model, tokenizer = mlx_load(str(folder))
    check_same_tokenizer(target_tokenizer, tokenizer)
    return MLXDraft(model)


class Pipeline:
    """A target (and optionally a draft) ready to generate in any mode."""

    def __init__(self, model: nn.Module, tokenizer: Any, draft: Optional[Draft] = None, exit_adapter: Any = None,
                 name: str = ""):
        self.model = model
        self.tokenizer = tokenizer
        self.draft = draft
        self.name = name
        self.engine = Engine(model, draft, exit_adapter)

    @property
    def stats(self) -> Stats:
        """Stats of the last generation."""
        return self.engine.stats

    def encode(self, prompt: Prompt) -> list[int]:
        """Text goes through the chat template when the tokenizer has one (as mlx-lm does); ids pass as is."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if getattr(self.tokenizer, "has_chat_template", False):
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                           add_generation_prompt=True))
        return list(self.tokenizer.encode(prompt))

    def options(self, max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                seed: Optional[int] = None, kappa: Optional[int] = None, gamma: Optional[int] = None,
                exit_layer: Optional[int] = None, mode: str = "auto", min_p: float = 0.0,
                repetition_penalty: Optional[float] = None, stop: bool = True,
                draft_timeout: float = 60.0) -> DecodeOptions:
        """mode="auto" becomes the tuned mode and knobs (mirror_mlx.tune.resolve); explicit ones win."""
        from .tune import resolve

        c = resolve(self, mode, kappa, gamma, exit_layer)
        return DecodeOptions(mode=c.mode, max_tokens=max_tokens, kappa=c.kappa, gamma=c.gamma,
                             exit_layer=c.exit_layer, temperature=temperature, top_p=top_p, top_k=top_k,
                             min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
                             draft_timeout=draft_timeout, why=c.why,
                             stop_tokens=tuple(self.tokenizer.eos_token_ids) if stop else ())

    def check(self, tokens: Sequence[int], **kwargs: Any) -> None:
        """Raise ValueError (one sentence) for options or a prompt this pipeline cannot serve."""
        self.engine.check(list(tokens), self.options(**kwargs))

    def stream(self, prompt: Prompt, **kwargs: Any) -> Iterator[Chunk]:
        """Yield text as tokens are committed; `pipe.stats` holds the stats afterwards."""
        tokens = self.encode(prompt)
        opts = self.options(**kwargs)
        detok = self.tokenizer.detokenizer
        detok.reset()
        for new in self.engine.generate(tokens, opts):
            new = [t for t in new if t not in opts.stop_tokens]
            for t in new:
                detok.add_token(t)
            yield Chunk(detok.last_segment, new)
        detok.finalize()
        if detok.last_segment:
            yield Chunk(detok.last_segment, [])

    def generate(self, prompt: Prompt, max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: Optional[int] = None, kappa: Optional[int] = None,
                 gamma: Optional[int] = None, exit_layer: Optional[int] = None, mode: str = "auto",
                 **kwargs: Any) -> Result:
        """Generate up to `max_tokens` tokens; stops early at the tokenizer's end-of-sequence tokens."""
        chunks = list(self.stream(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                  top_k=top_k, seed=seed, kappa=kappa, gamma=gamma, exit_layer=exit_layer,
                                  mode=mode, **kwargs))
        tokens = [t for c in chunks for t in c.tokens]
        stopped = self.stats.generation_tokens > len(tokens)
        return Result("".join(c.text for c in chunks), tokens, self.stats, "stop" if stopped else "length")

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
        self.engine.close()


def load(model: Optional[Union[str, Path]] = None, draft_model: Optional[Union[str, Path]] = None,
         exit_adapter: Optional[Union[str, Path]] = None, **_: Any) -> Pipeline:
    """Load a target and its draft. With no model, the embedded demo pair (works offline).

    `exit_adapter`: a `mirror-mlx train-exit` file that sharpens the early exit (never the target's
    own logits). The demo pair loads its shipped layer-2 adapter unless `exit_adapter="none"`.
    """
    if model is None:
        model = DEMO_TARGET
        draft_model = DEMO_DRAFT if draft_model is None else draft_model
        exit_adapter = DEMO_EXIT_ADAPTER if exit_adapter is None else exit_adapter
    if str(exit_adapter).lower() == "none":  # the demo's shipped adapter, turned off
        exit_adapter = None
    target, tokenizer = mlx_load(str(resolve_model(model)))
    draft = load_draft(draft_model, tokenizer) if draft_model is not None else None
    adapter = None
    if exit_adapter is not None:
        from .exit_adapter import load_adapter

        adapter = load_adapter(Path(exit_adapter), target)
    return Pipeline(target, tokenizer, draft, adapter, name=str(model))
