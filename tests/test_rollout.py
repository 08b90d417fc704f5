"""The branch rollout (mirror_mlx/drafts/mlx_draft.py): every window is the draft's own greedy continuation.

A rollout batches all branches into rows over one copy of the committed prefix (BranchRows);
these tests hold it to a plain loop that feeds each branch alone through mlx-lm's own cache.
"""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mirror_mlx.drafts.mlx_draft import MLXDraft
from models import CONFIGS, DRAFT_PATH, tiny_model
from mlx_lm import load


def plain_greedy(model, tokens: list[int], gamma: int) -> tuple[list[int], list[float]]:
    """`gamma` greedy tokens after `tokens`, one branch alone, and each step's top-2 logit gap."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([tokens]), cache=cache)[0, -1]
    out, gaps = [], []
    for _ in range(gamma):
        top2 = mx.sort(logits)[-2:].tolist()
        gaps.append(top2[1] - top2[0])
        out.append(int(mx.argmax(logits)))
        logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]
    return out, gaps


def spine_stems(spine: list[int], rows: int, vocab: int) -> list[list[int]]:
    return [spine[: i % (len(spine) + 1)] + [(13 * i + 5) % vocab] for i in range(rows)]


def check_windows(model, draft, context, stems, gamma, tie=1e-4):
    """Each window equals the plain loop's, except at a documented float near-tie (gap < tie)."""
    windows = draft.rollout(context, stems, gamma).windows
    for stem, window in zip(stems, windows):
        want, gaps = plain_greedy(model, list(context) + list(stem), gamma)
        k = next((i for i, (a, b) in enumerate(zip(window, want)) if a != b), None)
        assert k is None or gaps[k] < tie, f"stem {stem}: window {window} != greedy {want} (gap {gaps[k]})"
    assert draft.cached == list(context), "the draft's cache must keep committed tokens only"


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_windows_are_the_drafts_own_greedy_continuations_in_every_family(family):
    model = tiny_model(family)
    draft = MLXDraft(model)
    vocab = draft.vocab_size
    context = [(31 * i + 3) % vocab for i in range(9)]
    check_windows(model, draft, context, spine_stems([4, 8, 15], 9, vocab), gamma=4)
    # the next step: the context grows by accepted tokens, rows and stems change shape
    check_windows(model, draft, context + [4, 8, 2], spine_stems([16, 23], 5, vocab), gamma=3)


def test_rows_are_reused_across_rollouts_and_follow_a_rewound_context():
    model = load(str(DRAFT_PATH))[0]
    draft = MLXDraft(model)
    context = [(31 * i + 3) % 512 for i in range(40)]
    check_windows(model, draft, context, [[7]], gamma=5)  # the first window: one row
    check_windows(model, draft, context + [9], spine_stems([1, 2, 3, 4], 15, 512), gamma=4)
    keys = draft.rows[0].keys
    check_windows(model, draft, context + [9, 1, 2], spine_stems([5, 6, 7, 8], 15, 512), gamma=4)
    assert draft.rows[0].keys.shape == keys.shape, "branch scratch is allocated once, then reused"
    rewound = context[:30] + [99, 98]
    check_windows(model, draft, rewound, spine_stems([5, 6], 7, 512), gamma=4)
    longer = rewound + [(17 * i + 2) % 512 for i in range(260)]  # past the rows' capacity: they grow
    check_windows(model, draft, longer, spine_stems([5, 6], 7, 512), gamma=4)
    assert draft.rows[0].keys.shape[2] > keys.shape[2]
    draft.reset()
    assert draft.rows == [] and draft.rows_valid == 0


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_single_window_drafts_like_mlx_lm_in_gamma_forwards_on_the_drafts_own_cache(family):
    """sd's window (and a fallback's): the new context and the stem in the first of γ forwards, no scratch."""
    model = tiny_model(family)
    draft = MLXDraft(model, prefill_step_size=8)  # a context longer than a prefill step: its head in chunks
    vocab = draft.vocab_size
    context = [(31 * i + 3) % vocab for i in range(21)]
    for ctx, gamma in ((context, 4), (context + [4, 8], 3), (context[:12] + [5], 5), (context + [9] * 10, 1)):
        check_windows(model, draft, ctx, [[7]], gamma)
        assert draft.rows == []  # no branch scratch for one window
        assert draft.rollout(ctx, [[7]], gamma).forwards == gamma  # nothing new: γ forwards, as mlx-lm's
