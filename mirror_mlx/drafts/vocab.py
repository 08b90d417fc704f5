"""A trimmed head for any draft (`load(..., draft_vocab=V)`, `--draft-vocab V`): the draft scores only V token ids.

Why: a small draft's head is a large share of its step (SmolLM2's 49,152 rows, Qwen3's 151,669), and most of
its rows are ids text rarely holds; scoring V rows costs V/vocab of it (FR-Spec, arXiv 2502.14856; VocabTrim,
arXiv 2506.22694). Lossless: the target verifies every token, so one the draft cannot propose is still its own.

Which ids (`kept_ids`): the shipped training text (data/; never Spec-Bench's evaluation part) tokenized with
the draft's tokenizer; the V most frequent, ties by lower id, and the end-of-sequence and special ids always.
Computed at each load (about a second). How (`trim`): the lm_head keeps the kept rows (a tied head: a copy of
those embedding rows), and its logits keep the vocabulary's width, -inf off the kept ids (as distilled.py), so
the drafts and mlx-lm read real token ids unchanged.
"""

import copy
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..engine.model_parts import family, inner_model, text_model

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


@dataclass(frozen=True, repr=False)
class KeptIds:
    """The ids a trimmed head scores, as a bitmask over the vocabulary: a few KB however many ids are kept, so it
    travels on the draft host's command line (drafts/recipes.py) and keys a cache."""

    mask: bytes
    vocab: int

    @classmethod
    def of(cls, ids: Iterable[int], vocab: int) -> "KeptIds":
        bits = np.zeros(vocab, dtype=bool)
        bits[np.asarray(list(ids), dtype=np.int64)] = True
        return cls(np.packbits(bits).tobytes(), vocab)

    @property
    def ids(self) -> np.ndarray:
        """The kept ids, ascending."""
        bits = np.unpackbits(np.frombuffer(self.mask, dtype=np.uint8), count=self.vocab)
        return np.flatnonzero(bits).astype(np.int32)

    def __len__(self) -> int:
        return int(self.ids.size)

    def __str__(self) -> str:
        return f"draft_vocab={len(self)}"

    __repr__ = __str__


# ------------------------------------------------------------------------------------------ which ids


def shipped_text() -> list[str]:
    """The text whose token counts choose the kept ids: what data/ holds for training, never an evaluation part."""
    from ..corpus import load_split  # (the shipped text: a draft host never loads it, nor tqdm)
    from ..prompts import DATA, SETS, is_eval  # (as above)

    texts = list(load_split().train)
    for line in (DATA / SETS["spec_bench"]).read_text(encoding="utf-8").splitlines():
        row = json.loads(line) if line.strip() else None
        if row and not is_eval(int(row["question_id"])):
            texts += row.get("turns", [])
    for line in (DATA / "code_edit.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            texts.append(json.loads(line)["prompt"])
    return texts


def token_counts(tokenizer: "TokenizerWrapper", vocab: int) -> np.ndarray:
    """How often each id of a vocabulary of `vocab` occurs in `shipped_text()`, tokenized without special tokens."""
    # the Hugging Face tokenizer's batch call: mlx-lm's TokenizerWrapper passes attributes on, but not calls
    tok = getattr(tokenizer, "_tokenizer", tokenizer)
    rows = tok(shipped_text(), add_special_tokens=False)["input_ids"]  # type: ignore[operator]  # (the wrapped one)
    ids = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows if len(r)])
    return np.bincount(ids[ids < vocab], minlength=vocab)


def always_kept(tokenizer: "TokenizerWrapper") -> list[int]:
    """The ids every trimmed head keeps: the end-of-sequence ids first, then the tokenizer's other special ids."""
    eos = sorted(int(i) for i in getattr(tokenizer, "eos_token_ids", None) or ())
    special = sorted(int(i) for i in getattr(tokenizer, "all_special_ids", None) or ())
    return list(dict.fromkeys(eos + special))


def most_counted(counts: np.ndarray, size: int, always: Iterable[int] = ()) -> np.ndarray:
    """The `size` ids to keep, ascending: `always` first (in its order), then the most counted, ties by lower id."""
    first = [int(i) for i in dict.fromkeys(always) if 0 <= int(i) < len(counts)]
    taken = set(first)
    by_count = np.lexsort((np.arange(len(counts)), -np.asarray(counts)))  # count descending, then id ascending
    rest = [int(i) for i in by_count[: size + len(first)] if int(i) not in taken]
    return np.sort(np.array((first + rest)[:size], dtype=np.int32))


def kept_ids(tokenizer: "TokenizerWrapper", size: int, vocab: int) -> KeptIds:
    """The `size` ids a draft with this tokenizer and a head of `vocab` rows keeps (see the module's docstring)."""
    return KeptIds.of(most_counted(token_counts(tokenizer, vocab), size, always_kept(tokenizer)), vocab)


# ------------------------------------------------------------------------------------------ the head


def full_index(kept: mx.array, vocab: int) -> mx.array:
    """For each vocabulary id, its column in the trimmed logits, or V (the -inf column) when not kept."""
    index = mx.full((vocab,), kept.size, dtype=mx.int32)
    index[kept] = mx.arange(kept.size, dtype=mx.int32)
    return index


def full_logits(small: mx.array, index: mx.array) -> mx.array:
    """(..., V) logits over the kept ids as (..., vocab) logits, -inf off them, so consumers read real token ids."""
    pad = mx.full(small.shape[:-1] + (1,), -mx.inf, dtype=small.dtype)
    return mx.take(mx.concatenate([small, pad], axis=-1), index, axis=-1)


def trim(model: nn.Module, kept: KeptIds) -> nn.Module:
    """`model` (in place) with a head that scores only the kept ids; ValueError for a head this cannot reach (one
    forward checks it: a family whose logits come from elsewhere is refused, never left untrimmed unseen)."""
    ids = mx.array(kept.ids)
    tm, inner = text_model(model), inner_model(model)
    if isinstance(tm.get("lm_head"), nn.Module):
        module, method = tm["lm_head"], "__call__"
        rows = module  # trimmed in place: the whole head's rows are freed
    else:
        module, method = inner.get("embed_tokens", inner.get("embeddings")), "as_linear"
        rows = copy.copy(module)  # the embedding itself still reads every id
    if not isinstance(module, nn.Module):
        raise ValueError(f"draft_vocab: this {family(model)} draft has no lm_head or embedding to trim: leave "
                         "draft_vocab out")
    rows.update({k: v[ids] for k, v in module.items() if isinstance(v, mx.array)})
    cls, index = type(module), full_index(ids, kept.vocab)
    score = getattr(cls, method)
    module.__class__ = type("Kept" + cls.__name__, (cls,), {method: lambda self, x: full_logits(score(rows, x), index)})
    mx.eval(rows.parameters(), index)
    check_trimmed(model, kept)
    model.kept_size = len(kept)  # (a plain attribute, not a parameter: head_rows reads it)
    return model


def check_trimmed(model: nn.Module, kept: KeptIds) -> None:
    """One token's logits: every id off the kept set must score below every kept id (-inf, or a soft cap's floor)."""
    logits = np.array(model(mx.array([[0]]))[0, -1].astype(mx.float32))
    on = np.zeros(logits.size, dtype=bool)
    on[kept.ids] = True
    if on.all() or logits[~on].max() < logits[on].min():
        return
    raise ValueError(f"draft_vocab: this {family(model)} draft computes its logits without its lm_head or tied "
                     "embedding, so its head cannot be trimmed: leave draft_vocab out")


def head_rows(draft: object) -> Optional[int]:
    """How many ids a draft (a DraftRecipe or a draft object) scores when trimmed; None when its head is whole."""
    for arg in getattr(draft, "args", ()):
        if isinstance(arg, KeptIds):
            return len(arg)
    return getattr(getattr(draft, "model", None), "kept_size", None)
