"""TinyStories openings and the target's own greedy text over them.

The early exit only ever sees the text the engine commits, which is the target's greedy text, so
both the adapter's training data and the Ω_κ measurement are built from it, not from the corpus.
Openings are split into train / held-out by a hash of their text, so the same opening (and hence
the same greedy text) never lands on both sides, whatever order the corpus file has.
"""

import re
import zlib
from pathlib import Path
from typing import Iterable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from tqdm import tqdm

CORPUS = Path(__file__).resolve().parent / "data" / "tinystories_train.txt"
HELD_OUT_MOD = 10  # one opening in ten is held out

_SENTENCE = re.compile(r"^(.+?[.!?])(\s|$)", re.S)


def openings(text: str, min_words: int = 3) -> list[str]:
    """The first sentence of every paragraph, de-duplicated, in corpus order."""
    seen, out = set(), []
    for para in text.split("\n\n"):
        para = " ".join(para.split())
        m = _SENTENCE.match(para)
        first = m.group(1) if m else para
        if len(first.split()) >= min_words and first not in seen:
            seen.add(first)
            out.append(first)
    return out


def is_held_out(opening: str) -> bool:
    return zlib.crc32(opening.encode()) % HELD_OUT_MOD == 0


def split_openings(items: Iterable[str]) -> tuple[list[str], list[str]]:
    """(train, held_out): a fixed split by text hash."""
    train, held = [], []
    for s in items:
        (held if is_held_out(s) else train).append(s)
    return train, held


def load_openings(corpus: Optional[Path] = None, held_out: bool = False) -> list[str]:
    text = Path(corpus or CORPUS).read_text(encoding="utf-8")
    train, held = split_openings(openings(text))
    return held if held_out else train


def greedy_continuations(
    model: nn.Module,
    prompts: list[list[int]],
    max_tokens: int,
    eos: Iterable[int] = (),
    batch_size: int = 32,  # MLX on CPU: larger batches get slower per token
    progress: bool = False,
) -> list[list[int]]:
    """The model's greedy continuation of each prompt, cut after the first EOS.

    Prompts of equal length are batched together (no padding, so exact); order is preserved.
    """
    eos = set(eos)
    out: list[list[int]] = [[] for _ in prompts]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    batches = [idx[j : j + batch_size] for _, idx in sorted(by_len.items()) for j in range(0, len(idx), batch_size)]
    for idx in tqdm(batches, desc="greedy text", unit="batch", disable=not progress):
        cache = make_prompt_cache(model)
        y = mx.array([prompts[i] for i in idx])
        steps = []
        for _ in range(max_tokens):
            y = mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1, keepdims=True)
            mx.eval(y)
            steps.append(y)
        gen = mx.concatenate(steps, axis=1).tolist() if steps else [[] for _ in idx]
        for i, g in zip(idx, gen):
            cut = next((k + 1 for k, t in enumerate(g) if t in eos), len(g))
            out[i] = g[:cut]
    return out


def eos_ids(tokenizer) -> set[int]:
    ids = getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id]
    return {int(i) for i in ids if i is not None}
