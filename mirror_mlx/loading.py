"""Loading a model, once: a folder or Hugging Face id → (model, tokenizer); and the one check of a draft's tokenizer.

Every command and the API load targets and drafts here: plain mlx-lm folders through mlx_lm, and
Speculative-Streaming draft folders through their own classes. Errors are one ValueError sentence.
"""

import os
import sys
from pathlib import Path
from typing import Any, Optional, Union

import mlx.nn as nn
from mlx_lm.utils import load as mlx_load
from mlx_lm.utils import load_config, load_tokenizer

from . import validate


def resolve_model(path_or_id: Union[str, Path]) -> Path:
    """A local folder as is; otherwise a Hugging Face id through huggingface_hub (cached, offline-friendly)."""
    path = Path(path_or_id).expanduser()
    if path.exists():
        return validate.model_folder(path)
    name = str(path_or_id)
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ValueError(f"model path {name!r} does not exist: give a model folder or a Hugging Face id like org/name")
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.py", "*.model",
                                                              "*.tiktoken", "*.txt", "*.jinja"]))
    except Exception as e:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        raise ValueError(
            f"model {name!r} is not a local folder and could not be fetched from the Hugging Face hub"
            f"{' (HF_HUB_OFFLINE=1)' if offline else ''}: {type(e).__name__}. Download it once with network "
            f"(`hf download {name}`) or pass a local folder"
        ) from None
    return validate.model_folder(folder)


def load_model(path_or_id: Union[str, Path], **mlx_lm_options: Any) -> tuple[nn.Module, Any]:
    """(model, tokenizer) of an mlx-lm model folder, a Hugging Face id, or an SS draft folder.

    `mlx_lm_options` (adapter_path, tokenizer_config, trust_remote_code) go to mlx_lm.load."""
    from mirror_mlx.ane_draft.ss_model import is_ss_draft, load_ss_draft

    folder = resolve_model(path_or_id)
    if is_ss_draft(folder):
        return load_ss_draft(folder)
    try:
        model, tokenizer = mlx_load(str(folder), **mlx_lm_options)
    except Exception as e:
        raise ValueError(f"cannot load model {path_or_id}: {type(e).__name__}: {e}") from None
    check_vocabulary(model, tokenizer, folder)
    return model, tokenizer


def check_vocabulary(model: nn.Module, tokenizer: Any, folder: Path) -> None:
    """Refuse a tokenizer that can produce ids the model has no embedding for: such a pair decodes
    junk (or reads past the embedding) instead of failing. A model larger than its tokenizer is fine
    (Qwen pads its embedding)."""
    from .target import vocab_size

    size = vocab_size(model)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    ids = max(vocab.values(), default=-1) + 1
    if size and ids > size:
        raise ValueError(f"{folder}: the tokenizer has {ids} token ids but the model's vocabulary is {size} "
                         "(config.json vocab_size): the tokenizer belongs to another model; use the tokenizer "
                         "files that came with these weights")


def folder_tokenizer(folder: Union[str, Path]) -> Any:
    """A draft folder's tokenizer as mlx_lm.load gives a model's: its end-of-sequence ids are
    config.json's (generation_config.json's where it names them, as mlx_lm.utils.load_config reads
    them) plus the tokenizer's own, so a draft compares like with like against a loaded target."""
    folder = Path(folder)
    return load_tokenizer(folder, eos_token_ids=load_config(folder).get("eos_token_id"))


def tokenizer_mismatch(target_tok: Any, draft_tok: Any) -> Optional[str]:
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


def special_difference(target_tok: Any, draft_tok: Any) -> Optional[str]:
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


def check_draft_tokenizer(target_tok: Any, draft_tok: Any, draft: Any = "the draft") -> None:
    """Raise ValueError unless the draft's ids are the target's; say once on stderr (one line) where
    only their special ids differ, since the target's decide."""
    why = tokenizer_mismatch(target_tok, draft_tok)
    if why is not None:
        raise ValueError(f"{why}: use a draft trained with the target's tokenizer")
    note_special_difference(special_difference(target_tok, draft_tok), draft)


def note_special_difference(difference: Optional[str], draft: Any) -> None:
    """The one stderr line for special ids that differ between a target and its draft."""
    if difference is not None:
        print(f"mirror-mlx: note: {draft} shares the target's vocabulary but not its special ids ({difference}): "
              "the target's decide where a generation stops", file=sys.stderr)
