"""Prompt lookup (n-gram) drafting: proposals copied from the context, at no draft cost.

Code edits, summaries, retrieval answers and tool results repeat their context verbatim. The lookup
takes the longest recent n-gram of the tokens so far (n from `n_max` down to `n_min`) that occurred
earlier in the context (prompt + committed) and proposes the tokens that followed its most recent
earlier occurrence, up to γ. Nothing found: no proposal, and the step is the target's alone (or the
model draft's, beside one). The target verifies a proposal like any draft window, so every mode stays
lossless whatever the lookup proposes.

`propose` is the rule written plainly (a scan of the context); `NgramIndex` gives the same answers
from an index updated as tokens are committed, so a step costs O(new tokens), not O(context).
"""

from typing import Sequence

LOOKUP = "lookup"  # the draft model's name that means the prompt lookup alone (load(draft_model="lookup"))
NGRAM_MAX, NGRAM_MIN = 3, 1  # the n-gram lengths tried, longest first (measured: docs/design.md, prompt lookup)
NGRAM_MIN_BESIDE = 2  # beside a draft model: a one-token match is a worse guess than the draft's window
NGRAM_LIMIT = 64  # the longest n-gram the lookup takes (a longer match adds nothing a shorter one misses)


def propose(tokens: Sequence[int], gamma: int, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> list[int]:
    """The lookup's proposal after `tokens`: for n from n_max down to n_min, the last n tokens' most recent
    earlier occurrence (one that some token follows), and up to γ of the tokens after it; [] if none."""
    tokens = list(tokens)
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # most recent first; the tail itself excluded
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + gamma]
    return []


class NgramIndex:
    """For every n-gram (n_min ≤ n ≤ n_max) of the tokens so far, where the token after its most recent
    occurrence is; `extend` adds committed tokens, `propose` answers as `propose(self.tokens, ...)` does."""

    def __init__(self, tokens: Sequence[int] = (), n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN):
        self.n_max, self.n_min = n_max, n_min
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it last
        self.extend(tokens)

    def extend(self, new: Sequence[int]) -> None:
        """Add tokens: each one completes an occurrence (the n-grams just before it now have a follower)."""
        toks, after = self.tokens, self.after
        for t in new:
            i = len(toks)
            for n in range(self.n_min, min(self.n_max, i) + 1):
                after[tuple(toks[i - n : i])] = i
            toks.append(int(t))

    def propose(self, gamma: int) -> list[int]:
        toks = self.tokens
        for n in range(min(self.n_max, len(toks)), self.n_min - 1, -1):
            i = self.after.get(tuple(toks[len(toks) - n :]))
            if i is not None:
                return toks[i : i + gamma]
        return []
