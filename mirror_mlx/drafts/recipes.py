"""How the draft host builds each draft: a `DraftRecipe` names a builder and its arguments, picklable by
reference, so the host process builds the draft itself (its weights never cross the pipe)."""

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

from mirror_mlx.drafts.api import Draft
from mirror_mlx.drafts.vocab import KeptIds, trim

if TYPE_CHECKING:
    from mirror_mlx.drafts.mlx_draft import MLXDraft


@dataclass(frozen=True)
class DraftRecipe:
    """How the host builds its draft: `build(*args)`, run inside the host (picklable by reference)."""

    build: Callable[..., Draft]
    args: tuple = ()

    def __str__(self) -> str:
        return f"{self.build.__name__}({', '.join(map(str, self.args))})"


def mlx_draft(path: Union[str, Path], kept: Optional[KeptIds] = None) -> "MLXDraft":
    """A plain mlx-lm model folder as draft (the tokenizer was checked by whoever made the spec); `kept`: its
    head scores only those ids (vocab.py)."""
    from mirror_mlx.drafts.distilled.model_types import load_model  # (mlx-lm's loader, on a draft host's build)
    from mirror_mlx.drafts.mlx_draft import MLXDraft  # (a draft host loads its own draft kind only)

    model = load_model(Path(path))[0]
    return MLXDraft(model if kept is None else trim(model, kept))


@functools.lru_cache(maxsize=2)
def mlx_draft_model(path: str, kept: Optional[KeptIds] = None):
    """The mlx-lm model an `mlx_draft` recipe builds, loaded once in this process (mlx-lm's own
    speculative decoding in bench, tune's teacher-forced trace), beside the copy its host runs."""
    return mlx_draft(path, kept).model


def ss_draft(path: Union[str, Path], kept: Optional[KeptIds] = None) -> Draft:
    """A Speculative-Streaming draft folder; `kept` as for `mlx_draft`."""
    from mirror_mlx.drafts.ss.draft import SSDraft  # (a draft host loads its own draft kind only)

    draft = SSDraft.from_path(path)
    if kept is not None:
        trim(draft.model, kept)
    return draft
