"""Loading a model, once: a folder or Hugging Face id → (model, tokenizer), for every command and the API
(plain mlx-lm folders through mlx_lm, SS drafts through their own classes). Errors are one ValueError sentence.
"""

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union, cast

import mlx.nn as nn
from huggingface_hub import snapshot_download
from mlx_lm.utils import load as mlx_load

from mirror_mlx.drafts.distilled import model_types
from mirror_mlx.drafts.ss.model import is_ss_draft, load_ss_draft
from mirror_mlx.drafts.tokenizer import folder_tokenizer

from . import validate
from .engine.model_parts import vocab_size

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


def resolve_model(path_or_id: Union[str, Path]) -> Path:
    """A local folder as is; otherwise a Hugging Face id through huggingface_hub (cached, offline-friendly)."""
    path = Path(path_or_id).expanduser()
    if path.exists():
        return validate.model_folder(path)
    name = str(path_or_id)
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ValueError(f"model path {name!r} does not exist: give a model folder or a Hugging Face id like org/name")

    try:
        folder = Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.py", "*.model",
                                                              "*.tiktoken", "*.txt", "*.jinja"]))
    except Exception as e:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        raise ValueError(f"model {name!r} is not a local folder and could not be fetched from the Hugging Face hub"
                         f"{' (HF_HUB_OFFLINE=1)' if offline else ''}: {type(e).__name__}. Download it once with "
                         f"network (`hf download {name}`) or pass a local folder") from None
    return validate.model_folder(folder)


Pair = tuple[nn.Module, "TokenizerWrapper"]


def mlx_lm_load(path: str) -> Pair:
    """mlx_lm.load's (model, tokenizer): its annotation also allows the 3-tuple that return_config gives."""
    return cast(Pair, mlx_load(path))


def load_model(path_or_id: Union[str, Path], **mlx_lm_options: Any) -> Pair:
    """(model, tokenizer) of an mlx-lm model folder, a Hugging Face id, or an SS draft folder; `mlx_lm_options`
    (adapter_path, tokenizer_config, trust_remote_code) go to mlx_lm.load."""
    folder = resolve_model(path_or_id)
    if is_ss_draft(folder):
        return load_ss_draft(folder)
    try:
        if model_types.is_ours(folder):  # mlx_lm.load takes no get_model_classes: its two halves, with it
            model, tokenizer = model_types.load_model(folder)[0], folder_tokenizer(folder)
        else:
            model, tokenizer = cast(Pair, mlx_load(str(folder), **mlx_lm_options))
    except Exception as e:
        raise ValueError(f"cannot load model {path_or_id}: {type(e).__name__}: {e}") from None
    check_vocabulary(model, tokenizer, folder)
    return model, tokenizer


def check_vocabulary(model: nn.Module, tokenizer: "TokenizerWrapper", folder: Path) -> None:
    """Refuse a tokenizer that can produce ids the model has no embedding for: such a pair decodes
    junk (or reads past the embedding) instead of failing. A model larger than its tokenizer is fine
    (Qwen pads its embedding)."""
    size = vocab_size(model)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    ids = max(vocab.values(), default=-1) + 1
    if size and ids > size:
        raise ValueError(f"{folder}: the tokenizer has {ids} token ids but the model's vocabulary is {size} "
                         "(config.json vocab_size): the tokenizer belongs to another model; use the tokenizer "
                         "files that came with these weights")
