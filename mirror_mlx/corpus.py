"""The TinyStories corpus shipped in data/, split once: held-out openings and training paragraphs.

Every consumer takes its side of one split: the benchmark's `tinystories` prompts and the Ω_κ /
reuse measurements use the held-out openings; the Speculative-Streaming draft (mirror_mlx/train/ss_draft.py)
and the exit adapter (exit_adapter.py) train on the target's greedy text over the training
paragraphs. The first `HELD_OUT_PARAGRAPHS` paragraphs are held out (the shipped SS draft was
trained with that rule, see demo/ss_draft/training.json); a held-out opening that also begins a
training paragraph is dropped, so no training prompt ever starts with a benchmark opening.

The early exit only ever sees the text the engine commits, which is the target's greedy text, so
the adapter's training data and the Ω_κ measurement are built from it, not from the corpus.
"""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from tqdm import tqdm

from .engine.readback import int_rows

CORPUS = Path(__file__).resolve().parent / "data" / "tinystories_train.txt"
HELD_OUT_PARAGRAPHS = 200  # the corpus's first paragraphs: benchmark openings, never training text
OPENING_WORDS = (4, 8)  # an opening has 4..8 words (very short ones, like "The end.", are skipped)

_SENTENCE_END = re.compile(r"[.!?][\"”']?(?=\s|$)")


def paragraphs(text: str) -> list[str]:
    """The blank-line separated paragraphs, whitespace-normalised, empty ones dropped."""
    out = (" ".join(q.split()) for q in text.replace("\r\n", "\n").split("\n\n"))
    return [q for q in out if q]


def opening(paragraph: str, max_words: int = OPENING_WORDS[1]) -> str:
    """The paragraph's first sentence, or its first `max_words` words if the sentence is longer."""
    words = paragraph.split()
    m = _SENTENCE_END.search(paragraph)
    sentence = paragraph[: m.end()] if m else paragraph
    return " ".join(words[:max_words]) if len(sentence.split()) > max_words else " ".join(sentence.split())


def distinct_openings(paras: Iterable[str]) -> list[str]:
    """The openings of `paras` with 4..8 words, each once, in order."""
    seen, out = set(), []
    for p in paras:
        o = opening(p)
        if len(o.split()) >= OPENING_WORDS[0] and o not in seen:
            seen.add(o)
            out.append(o)
    return out


@dataclass(frozen=True)
class Split:
    train: list[str]  # training paragraphs (the draft and the adapter train on the target's text over them)
    held_out: list[str]  # benchmark openings: none begins a training paragraph

    @property
    def train_openings(self) -> list[str]:
        return distinct_openings(self.train)


def split(text: str, held_out: Optional[int] = None) -> Split:
    """The one corpus split: paragraphs[held_out:] train, openings of the first `held_out` are held out.
    By default HELD_OUT_PARAGRAPHS, or a tenth of a small corpus (under 2,000 paragraphs) so that it still trains."""
    paras = paragraphs(text)
    if held_out is None:
        held_out = min(HELD_OUT_PARAGRAPHS, max(1, len(paras) // 10))
    train = paras[held_out:]
    starts = {opening(p) for p in train}  # a training prompt is a prefix of its paragraph, often its opening
    held = [o for o in distinct_openings(paras[:held_out])
            if not any(p.startswith(o) for p in train) and not any(o.startswith(t) for t in starts)]
    return Split(train, held)


def load_split(corpus: Optional[Union[str, Path]] = None, held_out: Optional[int] = None) -> Split:
    return split(Path(corpus or CORPUS).read_text(encoding="utf-8"), held_out)


def greedy_continuations(
    model: nn.Module,
    prompts: list[list[int]],
    max_tokens: int,
    eos: Iterable[int] = (),
    batch_size: int = 32,  # MLX on CPU: larger batches get slower per token
    progress: bool = False,
    desc: str = "greedy text",  # the progress bar's label
) -> list[list[int]]:
    """The model's greedy continuation of each prompt, cut after the first EOS; prompts of equal length are
    batched together (no padding, so exact)."""
    eos = set(eos)
    out: list[list[int]] = [[] for _ in prompts]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    batches = [idx[j : j + batch_size] for _, idx in sorted(by_len.items()) for j in range(0, len(idx), batch_size)]
    for idx in tqdm(batches, desc=desc, unit="batch", disable=not progress):
        cache = make_prompt_cache(model)
        y = mx.array([prompts[i] for i in idx])
        steps = []
        for _ in range(max_tokens):
            y = mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1, keepdims=True)
            mx.eval(y)
            steps.append(y)
        gen = int_rows(mx.concatenate(steps, axis=1)) if steps else [[] for _ in idx]
        for i, g in zip(idx, gen):
            cut = next((k + 1 for k, t in enumerate(g) if t in eos), len(g))
            out[i] = g[:cut]
    return out


def eos_ids(tokenizer) -> set[int]:
    ids = getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id]
    return {int(i) for i in ids if i is not None}
