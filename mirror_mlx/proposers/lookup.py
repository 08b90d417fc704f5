"""Prompt lookup (n-gram) drafting: proposals copied from the context, at no draft cost.

Code edits, summaries, retrieval answers and tool results repeat their context verbatim. The lookup takes
the longest recent n-gram (n from `n_max` down to `n_min`) that occurred earlier in the context (prompt +
committed) and proposes up to γ of the tokens that followed its most recent earlier occurrence. The target
verifies a proposal like any draft window, so every mode stays lossless whatever it proposes. `NgramIndex`
is updated as tokens are committed, so a step costs O(new tokens), not O(context).

A wrong window is not free (a verify of γ + 1 rows costs more than a one-row forward), so `Lookup` cuts each
proposal to the length that pays (`best_length`) at the acceptance its kind has had: every proposal is scored
against the tokens then committed (`ProposalRecord`), which is what its verify would have accepted (in
distribution above temperature 0). Text whose context misleads the lookup soon gets no windows; a verbatim
copy gets long ones.
"""

from typing import Optional, Sequence

LOOKUP = "lookup"  # the draft model's name that means the prompt lookup alone (load(draft_model="lookup"))
NGRAM_MAX, NGRAM_MIN = 3, 1  # the n-gram lengths tried, longest first (measured: docs/design.md, prompt lookup)
NGRAM_MIN_BESIDE = 2  # beside a draft model: a one-token match is a worse guess than the draft's window
NGRAM_LIMIT = 64  # the longest n-gram the lookup takes (a longer match adds nothing a shorter one misses)
LOOKUP_GAMMA = 8  # the lookup alone's window: a copied continuation is cheap to propose long (measured: docs)
ROW_COST = 0.1  # a verify's cost per row past the first, in one-row forwards, where the pair has no measured one
# (measured on the real pair on a CPU: 0.04-0.07, BENCHMARKS.md; ~0.24 reported for 4-bit targets on Macs)
# before any proposal is scored: its first token right half the time, each next one after a right start 0.9
PRIOR_FIRST, PRIOR_LATER, PRIOR_WEIGHT = 0.5, 0.9, 2.0
MARGIN = 1.05  # a window must promise this many times a one-row forward's tokens per unit of time
POOL_WEIGHT = 4.0  # a kind's own counts weigh against every kind's rate this much


class NgramIndex:
    """For every n-gram (n_min ≤ n ≤ n_max) of the tokens so far, where the token after its most recent
    occurrence is; `extend` adds committed tokens."""

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

    def match(self, gamma: int) -> tuple[int, list[int]]:
        """(n, proposal): the length of the n-gram that matched (0 if none), and up to γ tokens after it."""
        toks = self.tokens
        for n in range(min(self.n_max, len(toks)), self.n_min - 1, -1):
            i = self.after.get(tuple(toks[len(toks) - n :]))
            if i is not None:
                return n, toks[i : i + gamma]
        return 0, []


class ProposalRecord:
    """Per kind of proposal (n-gram length, copying just now): of the proposals that reached position i (their
    first i - 1 tokens right), how many were right at i too."""

    def __init__(self) -> None:
        self.reached: dict[tuple, list[int]] = {}  # kind -> [proposals that reached position i + 1]
        self.right: dict[tuple, list[int]] = {}  # kind -> [of those, right at position i + 1]

    def score(self, kind: tuple, proposal: Sequence[int], then: Sequence[int]) -> None:
        """Count a proposal against the tokens committed after it (as many as are known)."""
        reached, right = self.reached.setdefault(kind, []), self.right.setdefault(kind, [])
        for i, (p, t) in enumerate(zip(proposal, then)):
            if i == len(reached):
                reached.append(0)
                right.append(0)
            reached[i] += 1
            if p != t:
                return
            right[i] += 1

    def survival(self, kind: tuple, length: int) -> list[float]:
        """P(the first i tokens of a proposal of this kind are right), i = 1..length: its first token right at
        one rate, each later one at another (a copy, once under way, tends to go on). Each rate is the kind's
        own, leaning on every kind's, which starts at the prior (PRIOR_FIRST, PRIOR_LATER)."""
        every = [(sum(_at(v, 0) for v in counts.values()), sum(sum(v[1:]) for v in counts.values()))
                 for counts in (self.right, self.reached)]
        right, reached = self.right.get(kind, []), self.reached.get(kind, [])
        first = _rate(_at(right, 0), _at(reached, 0), _rate(every[0][0], every[1][0], PRIOR_FIRST, PRIOR_WEIGHT))
        later = _rate(sum(right[1:]), sum(reached[1:]), _rate(every[0][1], every[1][1], PRIOR_LATER, PRIOR_WEIGHT))
        return [first * later ** i for i in range(length)]


def _at(counts: Sequence[int], i: int) -> int:
    return counts[i] if i < len(counts) else 0


def _rate(right: int, reached: int, prior: float, weight: float = POOL_WEIGHT) -> float:
    return (right + prior * weight) / (reached + weight)


def best_length(survival: Sequence[float], row_cost: float) -> int:
    """The window length g (0: none) with the most tokens per unit of time: a verify of g + 1 rows costs
    1 + row_cost * g one-row forwards and commits 1 + sum(survival[:g]) tokens on average; it must beat no
    window's one token a forward by MARGIN (the estimate is a few proposals' worth; a verify has other costs)."""
    best, rate, expected = 0, MARGIN, 1.0
    for g, s in enumerate(survival, start=1):
        expected += s
        if expected / (1.0 + row_cost * g) > rate:
            best, rate = g, expected / (1.0 + row_cost * g)
    return best


class Lookup:
    """The lookup draft of one generation: the index's proposals, each cut to the length that pays at its kind's
    acceptance so far (a `row_cost` of 0: the whole proposal), and `held`, the steps none paid at any length."""

    def __init__(self, tokens: Sequence[int] = (), n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN,
                 row_cost: Optional[float] = None):
        self.index = NgramIndex(tokens, n_max, n_min)
        self.row_cost = ROW_COST if row_cost is None else row_cost
        self.acceptance = ProposalRecord()
        self.pending: dict[int, tuple[tuple, list[int]]] = {}  # where a proposal starts -> (kind, proposal)
        self.copying = False  # the last token committed was one a proposal had right (a copy is under way)
        self.held = 0
        self._held_at = -1  # (where the last held proposal was counted: once per place)

    def offer(self, gamma: int) -> tuple[list[int], list[float]]:
        """The whole proposal after the tokens so far (up to γ; [] if none) and P(its first i tokens are right),
        i = 1..len: for a caller that weighs its own verify costs (the server's batch). It is scored as `propose`'s."""
        at = len(self.index.tokens)
        n, proposal = self.index.match(gamma)
        if not proposal:
            return [], []
        kind = (n, self.copying)
        if len(proposal) >= len(self.pending.get(at, ((), []))[1]):
            self.pending[at] = (kind, proposal)
        return proposal, self.acceptance.survival(kind, len(proposal))

    def propose(self, gamma: int) -> list[int]:
        """The window to verify after the tokens so far: the proposal, cut; [] when there is none or none pays
        (then counted in `held`). Asking again at the same place gives the same answer."""
        at = len(self.index.tokens)
        proposal, survival = self.offer(gamma)
        if not proposal or self.row_cost == 0:
            return proposal
        g = best_length(survival, self.row_cost)
        if g == 0 and at != self._held_at:
            self.held, self._held_at = self.held + 1, at
        return proposal[:g]

    def extend(self, new: Sequence[int]) -> None:
        """Commit tokens; every proposal whose fate they settle (a wrong token, or all of it committed) is scored."""
        self.index.extend(new)
        toks = self.index.tokens
        last = len(toks) - 1
        self.copying = any(at <= last < at + len(p) and toks[at:] == p[: len(toks) - at]
                           for at, (_, p) in self.pending.items())
        for at, (kind, proposal) in list(self.pending.items()):
            then = toks[at : at + len(proposal)]
            if len(then) == len(proposal) or then != proposal[: len(then)]:
                self.acceptance.score(kind, proposal, then)
                del self.pending[at]
