"""Model types of mirror-mlx's own, loaded through mlx-lm's `get_model_classes=` hook.

mlx-lm builds a folder's model from `mlx_lm.models.<model_type>`, where a distilled draft's type
(`mirror_distilled`, drafts/distilled/model.py) is not: every loader of ours passes mlx-lm's `load_model` our
classes for it (`load_model` below: the draft host's recipes, the trainers; mirror_mlx.loading for a model and
its tokenizer). Nothing is installed into mlx-lm: its own `mlx_lm.load` does not know these folders.
"""

from pathlib import Path
from typing import Union

import mlx.nn as nn
from mlx_lm.utils import load_config
from mlx_lm.utils import load_model as mlx_load_model

from .model import MODEL_TYPE, Model, ModelArgs

CLASSES = {MODEL_TYPE: (Model, ModelArgs)}


def is_ours(folder: Union[str, Path]) -> bool:
    """Whether the folder's config.json names one of our model types."""
    return load_config(Path(folder)).get("model_type") in CLASSES


def load_model(folder: Union[str, Path], lazy: bool = False) -> tuple[nn.Module, dict]:
    """mlx_lm.utils.load_model(folder, lazy); a folder of one of our model types gets its classes through the
    `get_model_classes` hook."""
    folder = Path(folder)
    model_type = load_config(folder).get("model_type")
    if model_type in CLASSES:
        return mlx_load_model(folder, lazy, get_model_classes=lambda config: CLASSES[model_type])
    return mlx_load_model(folder, lazy)
