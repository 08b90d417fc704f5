"""The whole-generation sampling check (tests/test_sampling_whole.py tells the method): an 8-token vocabulary
makes the target's processed distribution q(· | prefix) exact at every position, and `conditional_test`
compares the committed tokens' counts, grouped by their row in the step or the token before, with Σ q through
the exact covariance (a martingale chi-square, pooled over contexts)."""

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors
from scipy.stats import chi2

V = 8
PROMPT = [3, 1, 4]
KNOBS = dict(kappa=2, gamma=3, exit_layer=2)
MIN_EXPECTED = 5.0  # bins with a smaller expected count are pooled
SEEDED_P = 1e-4  # deterministic: seeds 0..RUNS-1
SHAPE = dict(vocab_size=V, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
             num_hidden_layers=4)
TOKENS = 20  # per generation
RUNS = 40  # generations per setting
SEEDS = {"mirror": range(RUNS), "sd": range(1000, 1000 + RUNS)}  # sd's own draws (seeded runs are mode-invariant)
SETTINGS = {
    "temperature": dict(temperature=1.0),
    "top_k": dict(temperature=1.0, top_k=3),
    "min_p": dict(temperature=1.0, min_p=0.1),
    "repetition_penalty": dict(temperature=0.8, repetition_penalty=1.5),
    "all": dict(temperature=1.2, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.2),
}


def processed_probs(model, outputs: np.ndarray, temperature: float, top_p: float = 1.0, top_k: int = 0,
                    min_p: float = 0.0, repetition_penalty=None) -> np.ndarray:
    """q[g, i] = the target's processed distribution of token i of generation g given the prompt and
    outputs[g, :i]: mlx-lm's logits processors, then its sampler's filters in make_sampler's order."""
    n, length = outputs.shape
    seqs = np.concatenate([np.tile(PROMPT, (n, 1)), outputs], axis=1)
    logits = model(mx.array(seqs[:, :-1]))[:, len(PROMPT) - 1 :].astype(mx.float32)  # (n, length, V)
    processors = make_logits_processors(repetition_penalty=repetition_penalty)
    if processors:
        rows = []
        for g in range(n):
            for i in range(length):
                row = logits[g, i][None]
                for p in processors:
                    row = p(mx.array(seqs[g, : len(PROMPT) + i]), row)
                rows.append(row)
        logits = mx.concatenate(rows).reshape(n, length, V)
    logprobs = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).reshape(n * length, V)
    if 0 < top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    if min_p != 0.0:
        logprobs = apply_min_p(logprobs, min_p)
    if top_k > 0:
        logprobs = apply_top_k(logprobs, top_k)
    probs = mx.softmax(logprobs * (1.0 / temperature), axis=-1)
    return np.array(probs, dtype=np.float64).reshape(n, length, V)


def rows_in_step(from_draft: list) -> list[int]:
    """Each committed token's row in its verify step: the drafted tokens just before it in that step."""
    rows, run = [], 0
    for drafted in from_draft:
        rows.append(run)
        run = run + 1 if drafted else 0
    return rows


def _bins(expected: np.ndarray, ordered: bool) -> list[list[int]]:
    """Categories grouped so that every bin expects at least MIN_EXPECTED (those expecting 0 dropped).
    Ordered categories (ranks) pool the tail; unordered ones (ids) pool the rare ones together."""
    live = [c for c in range(len(expected)) if expected[c] > 0]
    if ordered:
        bins: list[list[int]] = []
        for c in live:
            if bins and expected[bins[-1]].sum() < MIN_EXPECTED:
                bins[-1].append(c)
            else:
                bins.append([c])
        if len(bins) > 1 and expected[bins[-1]].sum() < MIN_EXPECTED:
            tail = bins.pop()
            bins[-1] += tail
        return bins
    bins = [[c] for c in live if expected[c] >= MIN_EXPECTED]
    rare = [c for c in live if expected[c] < MIN_EXPECTED]
    if rare:
        if expected[rare].sum() >= MIN_EXPECTED or not bins:
            bins.append(rare)
        else:
            min(bins, key=lambda b: expected[b].sum()).extend(rare)
    return bins


def _quadratic_form(onehot: np.ndarray, probs: np.ndarray, ordered: bool) -> tuple[float, int]:
    """(O - E)ᵀ Σ⁻¹ (O - E) over the binned categories, and its degrees of freedom.

    Each draw contributes its own categorical covariance diag(q) - q qᵀ to Σ: under the null the
    statistic is asymptotically chi-square whatever the contexts (a sum of martingale differences)."""
    bins = _bins(probs.sum(axis=0), ordered)
    if len(bins) < 2:
        return 0.0, 0
    o = np.stack([onehot[:, b].sum(axis=1) for b in bins], axis=1)
    q = np.stack([probs[:, b].sum(axis=1) for b in bins], axis=1)
    d = (o - q).sum(axis=0)[:-1]
    cov = np.diag(q.sum(axis=0)) - q.T @ q
    cov = cov[:-1, :-1]
    return float(d @ np.linalg.solve(cov, d)), len(bins) - 1


def _chi_square(onehot: np.ndarray, probs: np.ndarray, strata: np.ndarray, ordered: bool) -> float:
    """p-value of the quadratic forms summed over strata (each a function of the tokens before the draw)."""
    stat, df = 0.0, 0
    for s in np.unique(strata):
        q, f = _quadratic_form(onehot[strata == s], probs[strata == s], ordered)
        stat, df = stat + q, df + f
    return float(chi2.sf(stat, df))


def _score(values: np.ndarray, tokens: np.ndarray, probs: np.ndarray) -> float:
    """Two-sided p-value of Σ (f(token) - E_q f) / sqrt(Σ Var_q f), for f given per draw as `values` (n, V)."""
    mean = (probs * values).sum(axis=1)
    var = (probs * values**2).sum(axis=1) - mean**2
    z = (values[np.arange(len(tokens)), tokens] - mean).sum() / np.sqrt(var.sum())
    return float(chi2.sf(z * z, 1))


def conditional_test(tokens: np.ndarray, probs: np.ndarray, rows: np.ndarray, previous: np.ndarray) -> dict:
    """p-values of four views of the committed tokens against their exact distributions q.

    `tokens` (n,), `probs` (n, V): every committed token with its q; `rows` its row in its step and
    `previous` the token before it (both decided before the draw, so q stays its distribution in each
    stratum). Token ids given the previous token catch a draw from the wrong context or noise reused
    across positions; ranks under q, per row, a row sampled wrongly (the bonus row, a reused branch's
    rows); the surprisal -log q (the score test of the temperature) a sampler too flat or too sharp;
    the count of each q's most likely token a sampler drawn to it (or to the draft, whose greedy
    proposals are the target's most likely tokens here)."""
    n = len(tokens)
    outside = probs[np.arange(n), tokens] == 0
    assert not outside.any(), f"{outside.sum()} committed tokens lie outside the processed distribution's support"
    order = np.argsort(-probs, axis=1, kind="stable")
    rank = np.argmax(order == tokens[:, None], axis=1)
    surprisal = np.where(probs > 0, -np.log(np.where(probs > 0, probs, 1.0)), 0.0)
    return {
        "id | previous token": _chi_square(np.eye(V)[tokens], probs, previous, ordered=False),
        "rank | row in step": _chi_square(np.eye(V)[rank], np.take_along_axis(probs, order, axis=1), rows,
                                          ordered=True),
        "surprisal": _score(surprisal, tokens, probs),
        "most likely token": _score((np.arange(V) == order[:, :1]).astype(float), tokens, probs),
    }


def sample(target, pipe, mode: str, settings: dict, seeds, expect: dict = None,
           branches: int = None, lookup: bool = False) -> tuple[dict, dict]:
    """Generate once per seed; returns the conditional test's p-values (against `expect`'s settings,
    by default the ones sampled with) and what the steps did. `lookup`: sd with the prompt lookup beside
    the draft."""
    outputs, rows = [], []
    seen = dict(reuses=0, fallbacks=0, rejections=0, draft_failures=0, lookup_accepted=0, lookup_rejections=0)
    extra = dict(lookup=True) if lookup else {}
    for seed in seeds:
        chunks = list(pipe.stream(PROMPT, max_tokens=TOKENS, seed=seed, mode=mode, stop=False, branches=branches,
                                  **KNOBS, **settings, **extra))
        stats, tokens = pipe.stats, [t for c in chunks for t in c.tokens]
        assert len(tokens) == TOKENS and stats.mode == mode
        assert branches is None or stats.branches_rolled <= branches * stats.steps
        outputs.append(tokens)
        rows.append(rows_in_step([d for c in chunks for d in c.from_draft]))
        for k in ("reuses", "fallbacks", "rejections", "lookup_accepted", "lookup_rejections"):
            seen[k] += getattr(stats, k)
        seen["draft_failures"] += stats.draft_failure is not None
    outputs, rows = np.array(outputs), np.array(rows)
    probs = processed_probs(target, outputs, **(expect or settings))
    previous = np.concatenate([np.full((len(outputs), 1), PROMPT[-1]), outputs[:, :-1]], axis=1)
    seen["per_row"] = np.bincount(rows.ravel(), minlength=KNOBS["gamma"] + 1).tolist()
    return conditional_test(outputs.ravel(), probs.reshape(-1, V), rows.ravel(), previous.ravel()), seen


def check_steps(mode: str, seen: dict) -> None:
    """The test is not vacuous: every row of a step (the bonus row too) committed tokens, windows were
    rejected, and mirror both reused a branch and fell back."""
    assert seen["draft_failures"] == 0
    assert all(n >= 20 for n in seen["per_row"]), f"{mode}: tokens per row in step {seen['per_row']}"
    assert seen["rejections"] >= 20, seen
    if mode == "mirror":
        assert seen["reuses"] >= 20 and seen["fallbacks"] >= 5, seen
