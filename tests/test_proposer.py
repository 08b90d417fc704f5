"""Which proposer a call runs is decided in one place (`Proposing`), from how the pair was loaded and the call's
mode and lookup; a proposer whose draft model is dropped hands over to the lookup's windows or the target alone."""

import pytest

from mirror_mlx.proposers.lookup import Lookup
from mirror_mlx.proposers.proposer import PROPOSERS, DraftWindows, LookupWindows, Mirror, TargetAlone
from mirror_mlx.proposers.proposing import KINDS, Proposing

MODEL, LOOKUP, RECYCLE, NONE = Proposing(True), Proposing(named="lookup"), Proposing(named="recycle"), Proposing()


@pytest.mark.parametrize("pair, mode, lookup, want", [
    (MODEL, "auto", None, ("mirror", False)),
    (LOOKUP, "auto", None, ("sd", True)),
    (RECYCLE, "auto", None, ("sd", True)),
    (RECYCLE, "auto", False, ("sd", False)),
    (NONE, "auto", None, ("ar", False)),
    (NONE, "auto", True, ("sd", True)),
    (LOOKUP, "ar", None, ("ar", False)),
    (MODEL, "sd", True, ("sd", True)),
])
def test_the_stand_in_mode_and_the_lookups_default(pair, mode, lookup, want):
    assert pair.stand_in(mode, lookup) == want


@pytest.mark.parametrize("pair, mode, lookup, kind, modelless", [
    (MODEL, "mirror", False, "mirror", ""),
    (MODEL, "mirror", True, "mirror", ""),
    (MODEL, "sd", True, "sd", ""),
    (MODEL, "ar", True, "lookup", ""),  # auto's lookup beside the target alone
    (MODEL, "ar", False, "ar", ""),
    (LOOKUP, "sd", True, "lookup", "lookup"),
    (NONE, "sd", True, "lookup", "lookup"),
    (RECYCLE, "sd", True, "recycle", "recycle"),
    (RECYCLE, "sd", False, "recycle", "recycle"),
    (RECYCLE, "ar", False, "ar", ""),
])
def test_one_proposer_per_call(pair, mode, lookup, kind, modelless):
    assert pair.kind(mode, lookup) == kind and kind in PROPOSERS
    assert pair.modelless(mode, lookup) == modelless


def test_the_default_mode_and_the_names_that_mean_no_model():
    assert [p.default_mode() for p in (MODEL, LOOKUP, RECYCLE, NONE)] == ["mirror", "sd", "sd", "ar"]
    assert [Proposing.name_of(d) for d in ("lookup", "recycle", "./draft", None)] == ["lookup", "recycle", "", ""]


def test_a_dropped_draft_leaves_the_lookup_with_its_state_else_the_target_alone():
    index = Lookup([1, 2, 3, 1, 2])
    sd = DraftWindows(None, index)
    sd.commit([3])
    alone = sd.alone()
    assert type(alone) is LookupWindows and alone.index is index and alone.held == sd.held
    assert alone.alone() is alone and not alone.drafts
    assert type(Mirror(None, None, None).alone()) is TargetAlone


def test_every_kind_named_is_a_proposer():
    assert set(KINDS) == set(PROPOSERS)
