"""How the draft host builds each draft: a `DraftRecipe` names a builder and its arguments, picklable by
reference, so the host process builds the draft itself (its weights never cross the pipe)."""

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Union

from mirror_mlx.draft_api import Draft


@dataclass(frozen=True)
class DraftRecipe:
    """How the host builds its draft: `build(*args)`, run inside the host (picklable by reference)."""

    build: Callable[..., Draft]
    args: tuple = ()

    def __str__(self) -> str:
        return f"{self.build.__name__}({', '.join(map(str, self.args))})"


def mlx_draft(path: Union[str, Path]) -> Draft:
    """A plain mlx-lm model folder as draft (the tokenizer was checked by whoever made the spec)."""
    from mlx_lm.utils import load_model

    from mirror_mlx.drafts.mlx_draft import MLXDraft

    return MLXDraft(load_model(Path(path))[0])


@functools.lru_cache(maxsize=2)
def mlx_draft_model(path: str):
    """The mlx-lm model an `mlx_draft` recipe builds, loaded once in this process (mlx-lm's own
    speculative decoding in bench, tune's teacher-forced trace), beside the copy its host runs."""
    return mlx_draft(path).model


def ss_draft(path: Union[str, Path]) -> Draft:
    """A Speculative-Streaming draft folder."""
    from mirror_mlx.drafts.ss_draft import SSDraft

    return SSDraft.from_path(path)
