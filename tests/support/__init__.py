"""What the tests share: the reference every lossless test compares with, the comparison itself, and the
small stand-ins the toy models need. Servers: support/servers.py; the whole-generation sampling check:
support/whole_sampling.py; ranks under mlx.launch: support/ranks.py."""

import copy

import mlx.core as mx
from mlx_lm.generate import generate_step

from mirror_mlx.engine.model_parts import text_model, trimmable_cache
from mirror_mlx.engine.target import EarlyExitTarget
from tests.models import DATA


def reference_greedy(model, prompt, n: int, eos=()) -> list[int]:
    """The tokens mlx-lm itself generates greedily from `prompt` (its generate_step, the loop under
    mlx_lm.generate and stream_generate): n of them, or up to and including the first of `eos`."""
    out = []
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(t))
        if out[-1] in eos:
            break
    return out


def greedy_uncached(model, prompt, n: int) -> list[int]:
    """Greedy with no cache at all: the whole sequence through the model for every token (for a model that
    takes no cache, and as a check of the cached loops themselves)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(mx.argmax(model(mx.array([seq]))[0, -1]).item()))
    return seq[len(prompt):]


def first_difference(got, want) -> str:
    """Where two token lists part: the first differing index and both tokens there (or which one is longer)."""
    got, want = list(got), list(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"token {i} differs: got {a}, the reference has {b} (the {i} before agree)"
    return f"got {len(got)} tokens, the reference has {len(want)} (the first {min(len(got), len(want))} agree)"


def assert_lossless(got, want, *context) -> None:
    """`got` (a mode's tokens) is exactly `want` (the reference's); else say where they part and what ran."""
    got, want = [int(t) for t in got], [int(t) for t in want]
    if got != want:
        where = f" ({', '.join(map(str, context))})" if context else ""
        raise AssertionError(f"not lossless{where}: {first_difference(got, want)}")


def openings(n: int) -> list[str]:
    """The first six words of the first n TinyStories paragraphs, each distinct opening once.

    Several paragraphs open alike: of the first 20, four repeat an earlier opening word for word (three
    more "Once upon a time, there was", one more "Once upon a time, in a"), and greedy decoding of the
    same prompt is the same generation again, so the repeats are left out (16 prompts from the first 20)."""
    paragraphs = [p for p in (DATA / "tinystories_train.txt").read_text().split("\n\n") if p.strip()]
    return list(dict.fromkeys(" ".join(p.split()[:6]) for p in paragraphs[:n]))


class FakeTokenizer:
    """Just enough tokenizer for models with a toy vocabulary."""

    def __init__(self, vocab_size):
        self.vocab_size, self.eos_token_ids = vocab_size, []

    @property
    def detokenizer(self):
        return _FakeDetok()


class _FakeDetok:
    last_segment = ""

    def reset(self): ...

    def add_token(self, t):
        self.last_segment = f"<{t}>"

    def finalize(self):
        self.last_segment = ""


def truncated(model, n_layers):
    """Oracle: the same weights with only the first n_layers blocks."""
    m = copy.deepcopy(model)
    inner = text_model(m).model
    inner.layers = inner.layers[:n_layers]
    if hasattr(inner, "end_idx"):
        inner.end_idx = n_layers
    return m


def check_two_logits(model, tokens, exit_layer):
    """The early-exit target's one forward gives exactly the truncated model's logits and the model's own."""
    oracle_early = truncated(model, exit_layer)(tokens)
    oracle_final = model(tokens)
    target = EarlyExitTarget(model, exit_layer)
    early, final = target.forward(tokens, trimmable_cache(target.model))
    mx.eval(early)
    mx.eval(final)
    assert mx.array_equal(early, oracle_early), f"early logits differ at exit layer {exit_layer}"
    assert mx.array_equal(final, oracle_final)
    target.remove()


def profile_row(mode: str, gamma, tokens: float, step_ms: float, kappa=None, exit_layer=None) -> dict:
    """One confirmed row of a tuning profile's table, measured as predicted."""
    return dict(mode=mode, kappa=kappa, gamma=gamma, exit_layer=exit_layer, tokens_per_step=tokens,
                measured_step_ms=step_ms, measured=1e3 * tokens / step_ms, predicted=1e3 * tokens / step_ms,
                confirmed=True)
