"""What a pair proposes with, and so which mode and proposer a call runs: decided here, once, for every way in
(the check, mode auto, the pipeline, mlx_lm.generate's signatures, the engine)."""

from dataclasses import dataclass
from typing import Optional

from .lookup import LOOKUP
from .recycle import RECYCLE

KINDS = ("ar", LOOKUP, RECYCLE, "sd", "mirror")  # the proposers (proposer.PROPOSERS): what `Proposing.kind` names


@dataclass(frozen=True)
class Proposing:
    """What a pair proposes with, as loaded: a draft model (`model`), or `named`, a draft_model name that means
    no model: "lookup" (the prompt lookup alone) or "recycle" (the target's recycled predictions, as trees).
    Each way in asks it which mode and proposer a call runs, rather than reading the draft's flags itself."""

    model: bool = False
    named: str = ""

    @staticmethod
    def name_of(draft_model: object) -> str:
        """The draft_model name that means no model ("lookup", "recycle"), else ""."""
        return str(draft_model) if str(draft_model) in (LOOKUP, RECYCLE) else ""

    def default_mode(self) -> str:
        """mlx_lm.generate's mode when none is given: sd with no model, mirror beside one, else the target alone."""
        return "sd" if self.named else "mirror" if self.model else "ar"

    def stand_in(self, mode: str, lookup: Optional[bool]) -> tuple[str, Optional[bool]]:
        """(the mode checked, whether the lookup proposes): mode auto as its stand-in (mirror beside a model;
        without one sd where the lookup or the recycled tree proposes, else ar); the lookup, unless asked, where a
        draft with no model runs sd."""
        if mode == "auto":
            wants = lookup or (lookup is None and bool(self.named))
            mode = "mirror" if self.model else "sd" if wants or self.named == RECYCLE else "ar"
        return mode, (bool(self.named) and mode == "sd") if lookup is None else lookup

    def modelless(self, mode: str, lookup: Optional[bool]) -> str:
        """"recycle" or "lookup" where sd runs with no draft model (nothing to calibrate), else ""."""
        if self.model or mode != "sd" or not (lookup or self.named == RECYCLE):
            return ""
        return RECYCLE if self.named == RECYCLE else LOOKUP

    def kind(self, mode: str, lookup: Optional[bool]) -> str:
        """The proposer a call in `mode` (mirror, sd or ar) runs: one of KINDS."""
        if mode == "mirror":
            return "mirror"
        if mode == "sd" and (self.model or self.named == RECYCLE):
            return "sd" if self.model else RECYCLE
        return LOOKUP if lookup else "ar"
