"""The branch budget: a mirror step rolls out the B branches the early exit scores likeliest, and only those."""

import re
from math import log

import pytest

from mirror_mlx.drafts.host import branch_stems
from mirror_mlx.engine.branch_budget import (RolloutCost, BranchBudget, Calibration, ExitView, branch_scores, pick,
                                             spread, stems)
from mirror_mlx.drafts.mlx_draft import MLXDraft
from mirror_mlx.pipeline import Pipeline
from mirror_mlx.validate import branch_budget
from tests.models import tiny_model
from tests.support import assert_lossless, FakeTokenizer, profile_row, reference_greedy

WINDOW = [5, 6, 7]  # γ = 3
CAND = [[10, 11], [20, 21], [30, 31], [40, 41]]  # C_0..C_3, κ = 2


def view(drafted, cand_probs) -> ExitView:
    return ExitView([[log(p) for p in row] for row in cand_probs], [log(p) for p in drafted])


def test_the_last_row_carries_most_mass_when_the_drafted_tokens_are_likely():
    """Each drafted token at 0.9: the step ends past the last row 0.9³ = 73% of the time, so C_γ's candidates
    come first; then row 0's (ends there 10%), whose best candidate has the exit's mass renormalised
    without the drafted token."""
    v = view([0.9, 0.9, 0.9], [[0.06, 0.02]] * 3 + [[0.5, 0.3]])
    s = branch_scores(WINDOW, CAND, v)
    assert s[3] == pytest.approx([0.729 * 0.5, 0.729 * 0.3])
    assert s[0] == pytest.approx([0.1 * 0.06 / 0.1, 0.1 * 0.02 / 0.1])
    assert s[1][0] == pytest.approx(0.9 * 0.1 * 0.6)
    assert pick(s, 2) == [(3, 0), (3, 1)]
    assert pick(s, 3) == [(0, 0), (3, 0), (3, 1)]  # listed by (row, candidate): one spine for the draft


def test_ties_go_to_the_earlier_row_then_the_higher_ranked_candidate():
    s = [[0.2, 0.1], [0.2, 0.2], [0.1, 0.0]]
    assert pick(s, 1) == [(0, 0)]
    assert pick(s, 2) == [(0, 0), (1, 0)]
    assert pick(s, 3) == [(0, 0), (1, 0), (1, 1)]
    assert pick(s, 4) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # 0.1 twice: row 0 before row 2


def test_a_candidate_equal_to_the_drafted_token_scores_nothing_at_its_row():
    """Row r ends only if ŷ_{r+1} is rejected, so ŷ_{r+1} cannot be the correction there (the excluded-token rule,
    when the candidate sets keep it)."""
    s = branch_scores(WINDOW, [[5, 11], [20, 21], [30, 31], [40, 41]], view([0.5] * 3, [[0.5, 0.2]] * 4))
    assert s[0][0] == 0.0 and s[0][1] > 0


def test_the_calibration_shifts_the_exit_toward_the_acceptance_seen():
    """An exit that gives the drafted tokens 1/64 each while the target accepts them all: the shift grows each
    step until the last row (reached only if all are accepted) carries most of the mass."""
    c = Calibration()
    assert c.accept(0.25) == pytest.approx(0.25)  # no shift before any step
    v = view([1 / 64] * 3, [[0.1, 0.1]] * 4)
    before = sum(branch_scores(WINDOW, CAND, v)[3]) / 0.2
    for _ in range(4):
        c.update(v, 3)
    assert c.accepted == c.judged == 12 and c.shift > 5
    after = sum(branch_scores(WINDOW, CAND, v, c)[3]) / 0.2
    assert before < 1e-5 and after > 0.5
    assert pick(branch_scores(WINDOW, CAND, v, c), 2) == [(3, 0), (3, 1)]
    c.update(v, 0)  # a rejection at the first row pulls it back
    assert c.accepted == 12 and c.judged == 13 and c.accept(1 / 64) < after ** (1 / 3)


def test_stems_and_windows_keep_each_branch_identity():
    picked = [(0, 1), (2, 0), (3, 1)]
    assert stems(WINDOW, CAND, picked) == [[11], [5, 6, 30], [5, 6, 7, 41]]
    laid = spread(CAND, picked, [["a"], ["b"], ["c"]])
    assert laid == [[None, ["a"]], [None, None], [["b"], None], [None, ["c"]]]
    every = [[c] for row in CAND for c in row]
    assert spread(CAND, None, every) == [[[c] for c in row] for row in CAND]
    assert pick([[1.0] * 2] * 4, None) is None and pick([[1.0] * 2] * 4, 8) is None  # every branch


@pytest.mark.parametrize("bad,message", [
    (0, "branches must be at least 1 (got 0): a step has kappa*(gamma+1) = 2*(3+1) = 8 to choose from"),
    (9, "branches must be at most 8 (got 9)"),
    (2.0, "branches must be an int, not float"),
])
def test_a_bad_budget_is_refused_with_one_sentence(bad, message):
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        branch_budget(bad, 2, 3)


class _Stems(MLXDraft):
    """A plain draft that records every rollout's stems."""

    def __init__(self, model):
        super().__init__(model)
        self.asked: list[list[list[int]]] = []

    def rollout(self, context, stems, gamma):
        self.asked.append([list(s) for s in stems])
        return super().rollout(context, stems, gamma)


@pytest.fixture(scope="module")
def pair():
    target, draft = tiny_model("llama_tied", seed=31, vocab_size=64), _Stems(tiny_model("llama_tied", seed=32,
                                                                                          vocab_size=64))
    pipe = Pipeline(target, FakeTokenizer(64), draft)
    yield target, draft, pipe
    pipe.close()


@pytest.mark.parametrize("branches", [1, 3, 7])
def test_the_budget_caps_the_branches_the_draft_rolls_out(pair, branches):
    """Every branch rollout holds at most B stems (the others, single stems, are the first window and fallbacks);
    the output is mlx-lm's, and a correction outside the B is a fallback."""
    target, draft, pipe = pair
    prompt = [3, 9, 14]
    draft.asked.clear()
    out = pipe.generate(prompt, max_tokens=30, mode="mirror", kappa=4, gamma=3, exit_layer=1, branches=branches,
                        stop=False)
    assert_lossless(out.tokens, reference_greedy(target, prompt, 30))
    assert max(len(s) for s in draft.asked) <= branches
    assert out.stats.branches_rolled <= branches * out.stats.steps
    assert out.stats.reuses + out.stats.fallbacks == out.stats.steps and out.stats.branches == branches
    assert "B=%d" % branches in out.stats.summary() and out.stats.as_dict()["branches_per_step"] > 0


def test_a_budget_of_every_branch_rolls_out_all_in_the_hosts_order(pair):
    """B = κ(γ+1): every branch step asks for all κ(γ+1) stems, in the order the host builds them from C_0..C_γ."""
    target, draft, pipe = pair
    draft.asked.clear()
    out = pipe.generate([3, 9, 14], max_tokens=30, mode="mirror", kappa=4, gamma=3, exit_layer=1, branches=16,
                        stop=False)
    batches = [s for s in draft.asked if len(s) > 1]
    assert batches and all(len(s) == 16 for s in batches)
    assert out.stats.branches_rolled == 16 * len(batches) and out.stats.branches == 16
    spine = batches[0][-1][:-1]
    assert batches[0] == branch_stems(3, spine, [s[-1] for s in batches[0]], 4)


def test_without_a_budget_the_branches_that_hide_or_pay_are_rolled_out():
    """B = None: by the generation's own clocks (branch rollouts of 4 and 8 rows: 10 ms and 5 ms a further
    row; a 22 ms suffix; a 10 ms serial window), branches in score order while the rollout still ends within
    the suffix (3 rows: 10 + 2 · 5 = 20 ms), and past it those whose score times the serial window (what
    reusing saves) beats the row's 5 ms. With one row count timed, the rollout is taken as all per row."""
    cost = RolloutCost()
    scores = [0.6, 0.2, 0.1, 0.6, 0.05]  # (not sorted: worth reads them in the order given)
    assert cost.worth(scores) == 5  # nothing timed yet: every branch
    cost.saw_step(8, 0.045, 0.022)
    assert cost.line() == pytest.approx((0.045 / 8, 0.045 / 8)) and cost.worth([0.0] * 8) == 3  # 5.6 ms a row
    cost.saw_step(4, 0.025, 0.022)
    cost.saw_window(0.010)
    assert cost.line() == pytest.approx((0.010, 0.005)) and cost.worth(scores) == 5 - 1  # the fourth pays its row
    assert cost.worth([0.1] * 8) == 3 and cost.worth([0.9] * 8) == 8 and cost.worth([0.0]) == 1
    plan = BranchBudget(None, cost=cost)
    v = view([0.9, 0.9, 0.9], [[0.06, 0.02]] * 3 + [[0.5, 0.3]])
    picked = plan.choose(WINDOW, CAND, v)
    assert picked is not None and 1 <= len(picked) < 8 and plan.rolled_out(CAND) == len(picked)
    assert BranchBudget(None, fit=False, cost=cost).choose(WINDOW, CAND, v) is None  # across ranks: every branch
    assert len(BranchBudget(6, cost=cost).choose(WINDOW, CAND, v)) == 6  # a B given is taken as it is


def test_the_budget_runs_on_the_target_thread_and_settles_after_the_verify():
    plan = BranchBudget(2)
    v = view([0.9, 0.9, 0.9], [[0.06, 0.02]] * 3 + [[0.5, 0.3]])
    assert plan.choose(WINDOW, CAND, v) == [(3, 0), (3, 1)] and plan.rolled_out(CAND) == 2
    plan.settle(3)
    assert plan.calibration.accepted == 3 and plan.view is None
    assert BranchBudget(None).choose(WINDOW, CAND, v) is None


def test_a_budget_is_checked_against_the_knobs_the_profile_picks():
    """mode="mirror" with B given and κ, γ left to the profile: B is checked once the profile has picked them
    (its row κ=2, γ=3 has 8 branches), with the same sentence as knobs given by hand."""
    import mirror_mlx
    from mirror_mlx.tune import profile as profiles

    pipe = mirror_mlx.load()
    pipe.auto.profile = profiles.Profile(key={}, mode="mirror", kappa=2, gamma=3, exit_layer=2, why="tuned",
                                         table=[profile_row("ar", None, 1.0, 10.0),
                                                profile_row("mirror", 3, 2.3, 20.0, kappa=2, exit_layer=2)])
    try:
        with pytest.raises(ValueError, match=re.escape("kappa*(gamma+1) = 2*(3+1) = 8")):
            pipe.generate("Once upon a time", max_tokens=4, mode="mirror", branches=20)
        assert pipe.generate("Once upon a time", max_tokens=4, mode="mirror", branches=8).stats.branches == 8
    finally:
        pipe.close()
