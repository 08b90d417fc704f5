"""The one check of a draft's tokenizer against the target's: the draft's loaded as mlx_lm.load loads a model's,
its ids compared, and special ids that differ said once (the target's decide)."""

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

from mlx_lm.utils import load_config, load_tokenizer

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


def folder_tokenizer(folder: Union[str, Path]) -> "TokenizerWrapper":
    """A draft folder's tokenizer as mlx_lm.load gives a model's: its end-of-sequence ids are
    config.json's (generation_config.json's where it names them, as mlx_lm.utils.load_config reads
    them) plus the tokenizer's own, so a draft compares like with like against a loaded target."""
    folder = Path(folder)
    # transformers reads config.json for the tokenizer and warns that it does not know our draft's model
    # type (ss_llama, mirror_distilled); the tokenizer is a plain one, so that warning is dropped here only
    configs = logging.getLogger("transformers.configuration_utils")
    configs.addFilter(_not_a_model_type_warning)
    try:
        return load_tokenizer(folder, eos_token_ids=load_config(folder).get("eos_token_id"))
    finally:
        configs.removeFilter(_not_a_model_type_warning)


def _not_a_model_type_warning(record: logging.LogRecord) -> bool:
    return "to instantiate a model of type" not in record.getMessage()


def tokenizer_mismatch(target_tok: "TokenizerWrapper", draft_tok: "TokenizerWrapper") -> Optional[str]:
    """Why a draft's tokenizer cannot be verified against the target's (one sentence), or None when
    both map the same strings to the same ids: otherwise every draft id means another token."""
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if len(t_vocab) != len(d_vocab):
        return f"the draft's tokenizer has {len(d_vocab)} tokens but the target's has {len(t_vocab)}"
    if t_vocab != d_vocab:
        diff = next(k for k in t_vocab if d_vocab.get(k) != t_vocab[k])
        return (f"target and draft tokenizers differ (token {diff!r} is {t_vocab[diff]} in the target, "
                f"{d_vocab.get(diff)} in the draft)")
    return None


def special_difference(target_tok: object, draft_tok: object) -> Optional[str]:
    """Which special ids differ (a phrase), or None. They never break verification: the draft is fed
    the target's token ids (the target's bos included) and never stops a generation, the target's
    end-of-sequence ids do. A draft trained with another bos or eos may only be accepted less."""
    parts = []
    for name, label in (("eos_token_ids", "end-of-sequence ids"), ("bos_token_id", "bos id")):
        t, d = getattr(target_tok, name, None), getattr(draft_tok, name, None)
        if isinstance(t, (set, frozenset, list, tuple)):
            t, d = sorted(t), sorted(d or ())
        if t != d:
            parts.append(f"{label} {t} in the target, {d} in the draft")
    return "; ".join(parts) or None


def check_draft_tokenizer(target_tok: "TokenizerWrapper", draft_tok: "TokenizerWrapper",
                          draft: object = "the draft") -> None:
    """Raise ValueError unless the draft's ids are the target's; say once on stderr (one line) where
    only their special ids differ, since the target's decide."""
    why = tokenizer_mismatch(target_tok, draft_tok)
    if why is not None:
        raise ValueError(f"{why}: use a draft trained with the target's tokenizer")
    note_special_difference(special_difference(target_tok, draft_tok), draft)


def note_special_difference(difference: Optional[str], draft: object) -> None:
    """The one stderr line for special ids that differ between a target and its draft."""
    if difference is not None:
        print(f"mirror-mlx: note: {draft} shares the target's vocabulary but not its special ids ({difference}): "
              "the target's decide where a generation stops", file=sys.stderr)
