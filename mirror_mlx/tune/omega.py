"""Ω_κ: how much of the target's final probability mass lies inside the early-exit top-κ set.

Measured along the target's own greedy text (the text the engine commits). Three views per row t:
- all rows: p_t(top-κ), the set the bonus row uses (and the issue's original figure);
- at a rejection, bare set: the engine corrects row r only when the draft token ŷ_{r+1} was
  rejected, and the correction is then drawn from p_t restricted to tokens ≠ ŷ (Leviathan's residual
  for a one-hot proposal). So Ω = Σ_t p_t(C_t \\ {ŷ_t}) / Σ_t (1 − p_t(ŷ_t)), rejection-weighted;
- at a rejection, excluded-token rule: the same with C_t = top-κ other than ŷ_t.
ŷ_t is the draft's greedy token after the same prefix, which is exactly what a greedy
autoregressive draft proposes there. At temperature 0 the correction is the target's argmax y_t
and a rejection happens iff ŷ_t ≠ y_t: `hit` is the share of those rows with y_t ∈ C_t.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..corpus import load_split
from ..demo import DRAFT, TARGET
from ..drafts.tokenizer import check_draft_tokenizer
from ..engine.batching import padded_batches
from ..engine.exit_adapter import load_adapter
from ..train.exit_adapter import greedy_rows
from ..engine.model_parts import text_model
from ..engine.readback import integer, ints, scalar
from ..engine.target import EarlyExitTarget, top_k
from ..loading import load_model

KAPPAS = (1, 2, 4, 8, 16)
# OmegaSums' sums per κ, each an Ω view, and its label in the table
VIEWS = {"plain": "all rows, top-κ", "bare": "at rejection, top-κ", "rule": "at rejection, rule",
         "hit_bare": "temp 0 hit, top-κ", "hit_rule": "temp 0 hit, rule"}


@dataclass
class OmegaSums:
    """Sums over rows (so runs add up); the ratios are the Ω figures."""

    kappas: tuple[int, ...]
    rows: int = 0
    plain: list[float] = field(default_factory=list)  # Σ p_t(top-κ)
    rejected: float = 0.0  # Σ (1 − p_t(ŷ_t))
    bare: list[float] = field(default_factory=list)  # Σ p_t(top-κ \ {ŷ_t})
    rule: list[float] = field(default_factory=list)  # Σ p_t(top-κ other than ŷ_t)
    misses: int = 0  # rows with ŷ_t ≠ y_t
    hit_bare: list[int] = field(default_factory=list)
    hit_rule: list[int] = field(default_factory=list)

    def __post_init__(self):
        for name in VIEWS:
            if not getattr(self, name):
                setattr(self, name, [0] * len(self.kappas))

    def add(self, other: "OmegaSums") -> None:
        self.rows += other.rows
        self.rejected += other.rejected
        self.misses += other.misses
        for name in VIEWS:
            setattr(self, name, [a + b for a, b in zip(getattr(self, name), getattr(other, name))])

    def omega(self, view: str) -> list[float]:
        """view: 'plain' (all rows), 'bare' or 'rule' (at a rejection), 'hit_bare' or 'hit_rule' (temperature 0)."""
        den = {"plain": self.rows, "bare": self.rejected, "rule": self.rejected,
               "hit_bare": self.misses, "hit_rule": self.misses}[view]
        return [v / den if den else float("nan") for v in getattr(self, view)]


def omega_sums(early: mx.array, final: mx.array, draft: Sequence[int], kappas: Sequence[int] = KAPPAS) -> OmegaSums:
    """Ω sums for rows of early-exit logits (n, V), final logits (n, V) and draft tokens ŷ (n,)."""
    kappas = tuple(kappas)
    kmax = max(kappas)
    p = mx.softmax(final.astype(mx.float32), axis=-1)
    y = mx.argmax(final, axis=-1)
    d = mx.array(list(draft), dtype=mx.int32)
    ids, _ = top_k(early, kmax)
    ids_ex, _ = top_k(early, kmax, exclude=list(draft))
    p_top = mx.cumsum(mx.take_along_axis(p, ids, axis=-1), axis=-1)
    p_ex = mx.cumsum(mx.take_along_axis(p, ids_ex, axis=-1), axis=-1)
    p_d = mx.take_along_axis(p, d[:, None], axis=-1)[:, 0]
    d_in = mx.cumsum((ids == d[:, None]).astype(mx.float32), axis=-1)  # ŷ within the first κ
    miss = y != d
    y_in = mx.cumsum((ids == y[:, None]).astype(mx.int32), axis=-1)
    y_in_ex = mx.cumsum((ids_ex == y[:, None]).astype(mx.int32), axis=-1)
    s = OmegaSums(kappas, rows=early.shape[0], rejected=scalar((1 - p_d).sum()), misses=integer(miss.sum()))
    for j, k in enumerate(kappas):
        s.plain[j] = scalar(p_top[:, k - 1].sum())
        s.bare[j] = scalar((p_top[:, k - 1] - d_in[:, k - 1] * p_d).sum())
        s.rule[j] = scalar(p_ex[:, k - 1].sum())
        s.hit_bare[j] = integer((miss & (y_in[:, k - 1] > 0)).sum())
        s.hit_rule[j] = integer((miss & (y_in_ex[:, k - 1] > 0)).sum())
    return s


@dataclass
class OmegaRow:
    layer: int
    adapter: str  # "-" for the bare head
    sums: OmegaSums


def measure(model: nn.Module, tokenizer, draft: nn.Module, texts: list[str], layers: Optional[Sequence[int]] = None,
            adapters: Optional[dict[int, tuple[str, nn.Module]]] = None, kappas: Sequence[int] = KAPPAS,
            max_tokens: int = 64, batch_size: int = 8, progress: bool = False) -> list[OmegaRow]:
    """Ω sums at each exit layer, bare head and (where `adapters[layer] = (name, adapter)`) with the adapter.

    The draft must share the target's tokenizer (run_omega checks it with drafts.tokenizer.check_draft_tokenizer).
    """
    n_layers = len(text_model(model).layers)
    layers = list(layers or range(1, n_layers))
    adapters = adapters or {}
    seqs, starts = greedy_rows(model, tokenizer, texts, max_tokens, progress=progress)
    variants = [(L, "-", None) for L in layers] + [(L, *adapters[L]) for L in layers if L in adapters]
    out = {(L, name): OmegaRow(L, name, OmegaSums(tuple(kappas))) for L, name, _ in variants}
    for j, chunk, tokens in padded_batches(seqs, batch_size):
        rows = [(b, t) for b, s in enumerate(chunk) for t in range(starts[j + b], len(s) - 1)]
        bi, ti = mx.array([b for b, _ in rows]), mx.array([t for _, t in rows])
        d_ids = ints(mx.argmax(draft(tokens)[bi, ti], axis=-1))
        for L, name, adapter in variants:
            target = EarlyExitTarget(model, L, adapter)
            try:
                early, final = target.forward(tokens, cache=None)
                out[(L, name)].sums.add(omega_sums(early[bi, ti], final[bi, ti], d_ids, kappas))
            finally:
                target.remove()
    return sorted(out.values(), key=lambda r: (r.layer, r.adapter != "-"))


def format_table(rows: list[OmegaRow]) -> str:
    """A markdown table: one line per (layer, adapter, view), one column per κ."""
    if not rows:
        return ""
    kappas = rows[0].sums.kappas
    head = "| layer | adapter | set | " + " | ".join(f"Ω{k}" for k in kappas) + " |"
    lines = [head, "|" + "---|" * (3 + len(kappas))]
    for r in rows:
        for view, label in VIEWS.items():
            vals = " | ".join(f"{v:.3f}" for v in r.sums.omega(view))
            lines.append(f"| {r.layer} | {r.adapter} | {label} | {vals} |")
    s = rows[0].sums
    lines += ["", f"{s.rows} rows; draft misses (ŷ ≠ target argmax) at {s.misses} rows "
                  f"({s.misses / max(s.rows, 1):.1%})."]
    return "\n".join(lines)


def run_omega(model_path: Optional[str] = None, draft_path: Optional[str] = None, adapter_paths: Sequence[str] = (),
              prompts: int = 50, max_tokens: int = 64, layers: Optional[Sequence[int]] = None,
              progress: bool = True) -> str:
    """`mirror-mlx omega`: the table over `prompts` held-out TinyStories openings (the demo pair by default)."""
    if prompts < 1:
        raise ValueError(f"--prompts must be at least 1, got {prompts}")
    if draft_path is None and model_path is not None:
        raise ValueError("--draft-model is needed with --model (the draft's greedy tokens are the excluded ones)")
    model, tokenizer = load_model(model_path or TARGET)
    draft, draft_tokenizer = load_model(draft_path or DRAFT)
    check_draft_tokenizer(tokenizer, draft_tokenizer, draft_path or DRAFT)
    n_layers = len(text_model(model).layers)
    for L in layers or ():
        if not 1 <= L <= n_layers - 1:
            raise ValueError(f"exit layer {L} is outside 1..{n_layers - 1}")
    adapters: dict[int, tuple[str, nn.Module]] = {}
    for p in adapter_paths:
        a = load_adapter(p, model)
        if a.exit_layer in adapters:
            raise ValueError(f"two exit adapters for layer {a.exit_layer}: pass one per layer")
        adapters[a.exit_layer] = (Path(p).stem, a)
    texts = load_split().held_out
    if prompts > len(texts):
        raise ValueError(f"--prompts {prompts} is more than the {len(texts)} held-out openings")
    rows = measure(model, tokenizer, draft, texts[:prompts], layers, adapters, max_tokens=max_tokens,
                   progress=progress)
    return format_table(rows)
