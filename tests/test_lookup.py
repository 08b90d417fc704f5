"""The prompt lookup's rule (mirror_mlx/proposers/lookup.py), its index, and what is refused with it.

Losslessness with the lookup is checked where every mode's is: test_families_lossless.py (greedy, alone
and beside a draft), test_seeded_sampling.py and test_sampling_whole.py (above temperature 0).
"""

import random

import pytest

import mirror_mlx
from mirror_mlx.proposers.lookup import (NGRAM_LIMIT, NGRAM_MAX, NGRAM_MIN, ProposalRecord, Lookup, NgramIndex,
                                         best_length)
from mirror_mlx.engine.stats import Stats
from tests.support import assert_lossless, profile_row, reference_greedy


# --- the rule --------------------------------------------------------------------------------------

def propose(tokens, gamma: int, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> list[int]:
    """The lookup's rule written plainly, a scan of the context (NgramIndex must answer as it does): for n
    from n_max down to n_min, the last n tokens' most recent earlier occurrence (one that some token
    follows), and up to γ of the tokens after it; [] if none."""
    tokens = list(tokens)
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # most recent first; the tail itself excluded
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + gamma]
    return []


def test_the_tokens_after_the_earlier_occurrence_are_proposed():
    assert propose([1, 2, 3, 4, 1, 2], gamma=5, n_max=2, n_min=1) == [3, 4, 1, 2]


def test_up_to_gamma():
    assert propose([1, 2, 3, 4, 5, 1, 2], gamma=2, n_max=2, n_min=1) == [3, 4]


def test_the_longest_ngram_wins():
    # "2" last followed 9 (position 5), but "1 2" occurred only at the start, followed by 3
    assert propose([1, 2, 3, 7, 2, 9, 1, 2], gamma=1, n_max=2, n_min=1) == [3]
    assert propose([1, 2, 3, 7, 2, 9, 1, 2], gamma=1, n_max=1, n_min=1) == [9]


def test_the_most_recent_occurrence_wins():
    assert propose([5, 1, 5, 2, 5], gamma=1, n_max=1, n_min=1) == [2]


def test_nothing_found_no_proposal():
    assert propose([1, 2, 3, 4], gamma=4, n_max=3, n_min=1) == []
    assert propose([1, 2, 3, 1], gamma=4, n_max=3, n_min=2) == []  # only a 1-gram repeats
    assert propose([], gamma=4) == [] and propose([7], gamma=4) == []


def test_the_tail_itself_is_no_occurrence():
    # [3, 3, 3]: the tail "3 3" occurred earlier at 0, followed by a 3; the tail at 1 has no follower
    assert propose([3, 3, 3], gamma=4, n_max=2, n_min=2) == [3]


@pytest.mark.parametrize("seed", range(6))
def test_the_index_answers_as_the_rule_as_tokens_come(seed):
    rng = random.Random(seed)
    n_max, n_min, gamma = rng.randint(1, 5), 1, rng.randint(1, 8)
    n_min = rng.randint(1, n_max)
    tokens = [rng.randrange(6) for _ in range(rng.randint(0, 10))]
    index = NgramIndex(tokens, n_max, n_min)
    for _ in range(40):
        assert index.match(gamma)[1] == propose(tokens, gamma, n_max, n_min), (tokens, n_max, n_min, gamma)
        new = [rng.randrange(6) for _ in range(rng.randint(1, 4))]
        tokens += new
        index.extend(new)


# --- the window that pays --------------------------------------------------------------------------

def test_a_window_is_as_long_as_it_pays():
    """A verify of g + 1 rows costs 1 + row_cost * g one-row forwards and commits 1 + the expected accepted
    tokens; no window commits one token a forward. A window must beat that by MARGIN (1.05)."""
    sure = [0.95 ** i for i in range(1, 9)]
    assert best_length(sure, row_cost=0.1) == 8  # a verbatim copy: the whole proposal
    assert best_length([0.5 * 0.8 ** i for i in range(8)], row_cost=0.1) == 5  # the prior's
    assert best_length([0.5 ** i for i in range(1, 9)], row_cost=0.1) == 2  # (1.75 / 1.2 beats 1.5 / 1.1)
    assert best_length([0.5 ** i for i in range(1, 9)], row_cost=0.24) == 1  # a dearer row: shorter
    assert best_length([0.08, 0.01, 0.001], row_cost=0.07) == 0  # right 8 % of the time: no window pays
    assert best_length([0.2, 0.04], row_cost=0.0) == 2  # every row free: the whole proposal
    assert best_length([], row_cost=0.1) == 0


def test_each_proposal_is_scored_against_what_was_committed():
    a = ProposalRecord()
    a.score((2, False), [5, 6, 7], [5, 6, 9])  # right twice, then wrong
    a.score((2, False), [5, 6], [5])  # right once; its second token not committed (not counted)
    assert (a.reached[2, False], a.right[2, False]) == ([2, 1, 1], [2, 1, 0])
    assert a.survival((2, False), 3)[0] > a.survival((2, False), 3)[1] > a.survival((2, False), 3)[2]


def test_misled_by_its_context_the_lookup_holds_back_and_it_counts_what_it_held():
    """Every proposal is scored, verified or not, against the tokens then committed: where the context's
    continuations keep being wrong the lookup soon proposes nothing, and says how often it held one back."""
    look = Lookup([1, 2, 3, 4], n_max=1, n_min=1)
    windows = []
    for new in range(100, 112):  # each time 1 comes back, what followed it last is proposed; a new token follows
        look.extend([1])
        windows.append(look.propose(4))
        look.extend([new])
    assert windows[0] == [2, 3, 4, 1]  # the prior: the first token right half the time, each next one 0.8
    assert windows[-1] == [] and look.held > 0
    assert look.propose(4) == look.propose(4) and look.held == look.held  # asking again changes nothing


def test_a_held_back_lookup_comes_back_when_the_context_repeats():
    """Held-back proposals are still scored, so the lookup sees the text turn verbatim without a verify."""
    look = Lookup([7, 8, 9], n_max=1, n_min=1, row_cost=0.1)
    for t in [7, 5, 7, 6, 7, 4, 7, 3, 7, 2]:  # after 7 comes something new every time
        look.propose(3)
        look.extend([t])
    assert look.propose(3) == [] and look.held
    for t in [1, 2, 3, 4, 5, 6] * 4:  # then the same six tokens, over and over
        look.propose(6)
        look.extend([t])
    assert look.propose(6) == [1, 2, 3, 4, 5, 6]


def test_at_no_cost_per_row_the_lookup_proposes_as_the_rule():
    rng = random.Random(0)
    tokens = [rng.randrange(5) for _ in range(20)]
    look = Lookup(tokens, n_max=3, n_min=1, row_cost=0.0)
    for _ in range(30):
        assert look.propose(6) == propose(tokens, 6, 3, 1) and look.held == 0
        new = [rng.randrange(5)]
        tokens += new
        look.extend(new)


def test_the_row_cost_is_fitted_to_the_profiles_measured_verify_widths():
    from mirror_mlx.tune.profile import Profile, row_cost

    timed = Profile(key={}, mode="ar", gamma=None, kappa=None, exit_layer=None, why="tuned", table=[],
                    calibration={"timings": {"verify": {"1": 0.080, "2": 0.0876, "4": 0.097, "8": 0.1169}}})
    assert row_cost(timed) == pytest.approx((0.095 + 0.2125 * 3 + 0.46125 * 7) / (1 + 9 + 49))  # through (1, 1)
    assert row_cost(None) is None
    assert row_cost(Profile(key={}, mode="ar", gamma=None, kappa=None, exit_layer=None, why="quick",
                            table=[])) is None


# --- the pipeline ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pipes():
    alone, pair = mirror_mlx.load(draft_model="lookup"), mirror_mlx.load()
    yield alone, pair
    alone.close()
    pair.close()


def test_the_lookup_alone_starts_no_draft_host(pipes):
    alone, _ = pipes
    assert alone.engine.host is None and alone.draft is None
    r = alone.generate("Once upon a time", max_tokens=12, mode="auto")
    assert r.stats.mode == "sd" and r.stats.lookup and r.stats.draft_forwards == 0
    assert r.stats.why.startswith("auto: the lookup alone") and r.stats.draft_host == ""
    assert alone.generate("Once upon a time", max_tokens=12, mode="ar").stats.lookup is False


@pytest.mark.parametrize("kwargs,message", [
    (dict(mode="ar", lookup=True), "mode='ar' is the target alone and takes no lookup"),
    (dict(mode="sd", lookup="yes"), "lookup must be True, False or None"),
    (dict(mode="sd", lookup=True, ngram_max=0), "ngram_max must be at least 1"),
    (dict(mode="sd", lookup=True, ngram_max=NGRAM_LIMIT + 1), f"ngram_max must be at most {NGRAM_LIMIT}"),
    (dict(mode="sd", lookup=True, ngram_max=2, ngram_min=3), "ngram_min must be at most 2"),
])
def test_bad_lookup_options_are_refused_in_one_sentence(pipes, kwargs, message):
    _, pair = pipes
    with pytest.raises((ValueError, TypeError), match=message):
        pair.generate("Once upon a time", max_tokens=4, gamma=3, **kwargs)


@pytest.mark.parametrize("mode", ["mirror", "sd"])
def test_the_lookup_alone_needs_sd(pipes, mode):
    """mirror has no model draft to branch with; sd with lookup=False has no draft at all."""
    alone, _ = pipes
    kwargs = dict(lookup=False) if mode == "sd" else {}
    with pytest.raises(ValueError, match=f"mode '{mode}' needs a draft model.*lookup"):
        alone.generate("Once upon a time", max_tokens=4, mode=mode, gamma=3, **kwargs)


@pytest.mark.parametrize("tuned", ["mirror", "ar"])
def test_auto_with_lookup_beside_a_draft(pipes, tuned):
    """auto's mirror takes the lookup as it is; where auto alone would run ar (the draft not paying), with
    lookup=True it runs the lookup beside the target alone (γ=8, n=3..1, as the lookup alone), no draft
    window at all, and says so; the tokens are mlx-lm's greedy ones, and a seeded sample is ar's."""
    from mirror_mlx.tune import profile as profiles

    _, pair = pipes
    table = [profile_row("ar", None, 1.0, 10.0 if tuned == "ar" else 40.0), profile_row("sd", 2, 1.6, 30.0),
             profile_row("sd", 4, 1.8, 35.0), profile_row("mirror", 3, 2.3, 20.0, kappa=2, exit_layer=2)]
    pair.auto.profile = profiles.Profile(key={}, mode=tuned, gamma=3 if tuned == "mirror" else None,
                                         kappa=2 if tuned == "mirror" else None, exit_layer=2, why="tuned",
                                         table=table)
    try:
        r = pair.generate(SUMMARY, max_tokens=32, mode="auto", lookup=True, stop=False)
        if tuned == "mirror":
            assert (r.stats.chosen_mode, r.stats.kappa, r.stats.gamma, r.stats.lookup) == ("mirror", 2, 3, True)
        else:
            s = r.stats
            assert (s.chosen_mode, s.gamma, s.lookup, s.draft_forwards, s.rollouts) == ("ar", 8, True, 0, 0), s.why
            assert s.why.startswith("auto with lookup: the lookup beside the target alone, gamma=8 (auto alone: ar")
            assert s.lookup_accepted > 0 and s.proposed == s.lookup_proposed, s.summary()
            ref = reference_greedy(pair.model, pair.encode(SUMMARY), 32)
            assert_lossless(r.tokens, ref)  # mlx-lm's own greedy tokens
            sampled = pair.generate(SUMMARY, max_tokens=24, mode="auto", lookup=True, temperature=0.8, seed=7,
                                    stop=False)
            assert (sampled.stats.chosen_mode, sampled.stats.lookup) == ("ar", True) and sampled.stats.lookup_proposed
            assert_lossless(sampled.tokens, pair.generate(SUMMARY, max_tokens=24, mode="ar", temperature=0.8, seed=7,
                                                          stop=False).tokens)  # the target's own seeded sample
            assert pair.generate(SUMMARY, max_tokens=8, mode="auto", lookup=True, gamma=4).stats.gamma == 4
            index_n = pair.resolve(pair.plan(SUMMARY, max_tokens=8, mode="auto", lookup=True)).opts
            assert (index_n.ngram_max, index_n.ngram_min) == (3, 1)
            assert pair.resolve(pair.plan(SUMMARY, max_tokens=8, mode="auto", lookup=True, ngram_min=2)).opts.ngram_min == 2
    finally:
        pair.auto.profile = None


def test_the_summary_counts_accepted_tokens_by_source():
    s = Stats(mode="sd", gamma=4, lookup=True, proposed=30, accepted=12, lookup_proposed=10, lookup_accepted=5,
              generation_tokens=20, target_forwards=8, decode_seconds=1.0)
    assert "accepted: lookup 5/10, draft 7/20" in s.summary()
    assert (s + s).lookup and (s + s).lookup_accepted == 10
    assert "lookup" not in Stats(mode="sd", gamma=4).summary()


def test_the_shortest_ngram_is_one_alone_and_two_beside_a_draft(pipes):
    alone, pair = pipes
    assert alone.check([1], mode="sd").opts.ngram_min == 1
    assert pair.check([1], mode="sd", lookup=True).opts.ngram_min == 2
    assert pair.check([1], mode="sd", lookup=True, ngram_max=1).opts.ngram_min == 1
    assert pair.check([1], mode="sd", lookup=True, ngram_min=1).opts.ngram_min == 1


def test_the_summary_of_the_lookup_alone_names_no_draft():
    s = Stats(mode="sd", gamma=8, lookup=True, proposed=10, accepted=5, lookup_proposed=10, lookup_accepted=5)
    assert s.summary().endswith("mode sd γ=8 | accepted: lookup 5/10")


SUMMARY = ("Once upon a time there was a little girl named Lily. She loved to play outside in the park with her "
           "dog Max. One day she found a big red ball under a tree. She was very happy and she played with the "
           "ball all day.\nTell me the story again.\nOnce upon a time")


def test_in_mirror_the_lookup_fills_windows_after_a_fallback(pipes):
    """mirror with lookup=True: after a step that reused no branch, the lookup's window (when the context
    offers one) replaces the draft's serial rollout; the tokens are ar's, the lookup's windows were
    accepted and rejected, and fewer rollouts ran than without it."""
    _, pair = pipes
    # (every branch, B = κ(γ + 1): which steps fall back then follows from the tokens, not the machine's timings)
    kw = dict(max_tokens=96, mode="mirror", kappa=1, gamma=3, exit_layer=2, branches=4, stop=False)
    ar = pair.generate(SUMMARY, max_tokens=96, mode="ar", stop=False).tokens
    plain, looked = pair.generate(SUMMARY, **kw), pair.generate(SUMMARY, lookup=True, **kw)
    assert_lossless(plain.tokens, ar, "without the lookup")
    assert_lossless(looked.tokens, ar, "with the lookup")
    s = looked.stats
    assert s.lookup_accepted > 0 and s.lookup_rejections > 0 and s.lookup_windows <= s.fallbacks + 1, s.summary()
    assert s.rollouts < plain.stats.rollouts, (s.summary(), plain.stats.summary())


def test_windows_cut_or_whole_the_tokens_are_the_targets(pipes):
    """The cut only chooses how much of a proposal is verified: cut (the default) or whole (row_cost=0), the
    tokens are ar's; cut, fewer tokens are proposed, and the proposals held back are counted and said."""
    alone, _ = pipes
    ar = alone.generate(SUMMARY, max_tokens=96, mode="ar", stop=False)
    cut = alone.generate(SUMMARY, max_tokens=96, stop=False)
    whole = alone.generate(SUMMARY, max_tokens=96, stop=False, row_cost=0)
    assert_lossless(cut.tokens, ar.tokens, "cut")
    assert_lossless(whole.tokens, ar.tokens, "whole")
    assert whole.stats.lookup_held == 0 and cut.stats.lookup_proposed < whole.stats.lookup_proposed
    assert cut.stats.lookup_held > 0 and f"(held back {cut.stats.lookup_held}x)" in cut.stats.summary()
    with pytest.raises(ValueError, match=r"row_cost must be \[0, 10\] \(got -1.0\): a verify's cost per row"):
        alone.generate(SUMMARY, max_tokens=4, row_cost=-1)


def test_the_lookup_is_refused_across_ranks():
    from mirror_mlx.distributed.pipeline import NO_LOOKUP, load

    with pytest.raises(ValueError, match="the prompt lookup runs in one process"):
        load("any-model", draft_model="lookup")
    assert "mlx.launch" in NO_LOOKUP
