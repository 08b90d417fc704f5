"""The acceptance traces tune predicts from: the calibration prompts, the target's greedy text after each,
the draft's window at every position of it, and the early exit's rank of the target's token at each
candidate exit layer (cost_model.Trace), all from real forwards of the loaded models."""

from functools import partial
from typing import TYPE_CHECKING, Optional, Sequence, Union, cast

import mlx.core as mx

from ..corpus import greedy_continuations, load_split
from ..drafts.mlx_draft import MLXDraft
from ..drafts.recipes import DraftRecipe, mlx_draft, mlx_draft_model
from ..engine.exit_adapter import adapter_for
from ..options import DRAFT_TIMEOUT_S
from ..engine.target import EarlyExitTarget
from ..engine.readback import ints
from ..prompts import chat_calibration, load_prompts
from ..text import has_chat_template
from .cost_model import Trace
from .profile import PairView

if TYPE_CHECKING:
    import mlx.nn as nn

CALIBRATION_POOL = 40  # tune's prompts come from the last this-many held-out openings


def calibration_prompts(pipe: PairView, n: int, path: Optional[str] = None) -> list[list[int]]:
    """Token ids of `n` prompts: the user's file, a chat model's Spec-Bench training part through its template
    (the bench evaluates on the other part), else n of the *last* 40 held-out TinyStories openings (benchmarks
    take theirs from the front), as many as can be of one token length so that they share each forward of the
    traces' greedy texts. Whole openings, not cut ones: a cut opening's greedy text is less predictable (γ=3
    accepted 2.18 tokens a step on openings cut to 13 tokens, 2.43 whole)."""
    if path:
        return [pipe.encode(p.text) for p in load_prompts(path, n)]
    if has_chat_template(getattr(pipe, "tokenizer", None)):
        return [pipe.encode(p.text) for p in chat_calibration(n)]

    pool = [pipe.encode(t) for t in reversed(load_split().held_out[-CALIBRATION_POOL:])]  # last first
    by_len: dict[int, list] = {}
    for ids in pool:
        by_len.setdefault(len(ids), []).append(ids)
    common = max(by_len, key=lambda k: (min(len(by_len[k]), n), k))  # the length most of them share
    same = by_len[common][:n]
    return same + [ids for ids in pool if len(ids) != common][: n - len(same)]


def _ranks(logits: mx.array, targets: list[int], exclude: list[int]) -> tuple[list[int], list[int]]:
    """Rank of each row's target token (0 = top) with and without the excluded token."""
    logits = logits.astype(mx.float32)
    t = mx.array(targets)[:, None]
    score = mx.take_along_axis(logits, t, axis=-1)
    above = logits > score
    plain = above.sum(axis=-1)
    ex = mx.array(exclude)[:, None]
    ex_above = mx.take_along_axis(above, ex, axis=-1)[:, 0] & (ex[:, 0] != t[:, 0])
    return ints(plain - ex_above), ints(plain)


def plain_draft_model(pipe: PairView) -> Optional["nn.Module"]:
    """The draft as a plain MLX model in this process, for the teacher-forced trace: the MLXDraft object
    itself, or for `load()`'s recipe of a plain mlx-lm draft (it lives in the host process) a copy loaded
    here (small; one forward per prompt instead of one host rollout per position). None for other drafts
    (SS drafts propose more than argmax chains, Core ML runs elsewhere): the trace then uses host rollouts."""
    draft = getattr(pipe, "draft", None)
    if isinstance(draft, DraftRecipe) and draft.build is mlx_draft:
        return mlx_draft_model(*draft.args)
    return draft.model if type(draft) is MLXDraft else None  # subclasses (SS) propose more than argmax chains


def greedy_texts(pipe: PairView, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The target's greedy continuation of each prompt (prompts of one length share each forward)."""
    eos = tuple(getattr(pipe.tokenizer, "eos_token_ids", ()) or ())
    return pipe.engine.on_target(partial(greedy_continuations, pipe.model, prompts, max_tokens, eos=eos))


def trace(pipe: PairView, prompt: list[int], max_tokens: int, exit_layers: Sequence[int], gamma_max: int,
          draft_model: "Union[str, nn.Module, None]" = "auto",
          text: Optional[list[int]] = None) -> tuple[Trace, list[int]]:
    """The acceptance trace of one prompt (cost_model.Trace) from real forwards of both models, and
    the prompt plus the target's greedy text (`text`, else generated here).

    The draft side: one teacher-forced forward of `draft_model` ("auto": `plain_draft_model(pipe)`),
    else (None) one blocking rollout per position through the draft host. Across ranks the draft side
    runs on rank 0 alone; the other ranks run the target's forwards only (their trace is not used).
    """
    engine = pipe.engine
    host = engine.draft_host  # None on a rank beside rank 0
    if draft_model == "auto":
        draft_model = plain_draft_model(pipe) if host is not None else None
    if text is None:
        text = greedy_texts(pipe, [prompt], max_tokens)[0]
    full = list(prompt) + text
    n0 = len(prompt)

    def draft_runs() -> tuple[list[int], list[int]]:
        runs, first = [], []
        for i in range(n0, len(full)):
            w = host.rollout(full[: i - 1], [[full[i - 1]]], gamma_max, timeout=DRAFT_TIMEOUT_S).windows[0]
            a = 0
            while a < len(w) and i + a < len(full) and w[a] == full[i + a]:
                a += 1
            runs.append(a)
            first.append(w[0])
        return runs, first

    def teacher_forced() -> tuple[list[int], list[int]]:
        """A plain autoregressive draft: one forward over the text gives its token at every position."""
        model = cast("nn.Module", draft_model)  # ("auto" resolved above; called only with a model)
        first = ints(mx.argmax(model(mx.array([full[:-1]]))[0, n0 - 1:], axis=-1))
        runs = [0] * (len(text) + 1)
        for i in range(len(text) - 1, -1, -1):
            runs[i] = min(gamma_max, runs[i + 1] + 1) if first[i] == text[i] else 0
        return runs[:-1], first

    if host is None:  # a rank beside rank 0: the early exit's forwards below, nothing of the draft
        runs, first = [0] * len(text), list(text)
    else:
        runs, first = engine.on_target(teacher_forced) if draft_model is not None else draft_runs()
    tr = Trace(runs=runs)

    def ranks(layer: int) -> tuple[list[int], list[int]]:
        tapped = EarlyExitTarget(pipe.model, layer, adapter_for(engine.exit_adapter, layer))
        try:
            early, _ = tapped.forward(mx.array([full[:-1]]), cache=None)
            return _ranks(early[0, n0 - 1:], text, first)
        finally:
            tapped.remove()

    for layer in exit_layers:
        tr.rank_excl[layer], tr.rank_plain[layer] = engine.on_target(ranks, layer)
    return tr, full
