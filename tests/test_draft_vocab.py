"""`draft_vocab`: the draft's head scores only V token ids (mirror_mlx/drafts/vocab.py), and every mode stays lossless.

The kept ids are the V most frequent in the shipped text under the draft's tokenizer, eos and special ids always,
ties by id: the same set every time. A trimmed draft proposes only kept ids; the target verifies every token,
so greedy output is mlx-lm's own greedy generation in every family, a seeded sample is the same in every mode, and
at temperature 1 every committed token follows the target's distribution, also where (often, with 3 of 8 ids
kept) the draft could not propose the target's token. A bad V is one sentence naming draft_vocab (--draft-vocab).
"""

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

import mirror_mlx
from mirror_mlx import demo as demo_pair, validate
from mirror_mlx.drafts import vocab as draft_vocab
from mirror_mlx.cli import main
from mirror_mlx.drafts.tokenizer import folder_tokenizer
from mirror_mlx.drafts.vocab import KeptIds, kept_ids, trim
from mirror_mlx.drafts.mlx_draft import MLXDraft
from mirror_mlx.drafts.ss.draft import SSDraft
from mirror_mlx.pipeline import Pipeline, load_draft, trimmed_head
from tests.models import CACHE_FAMILIES, CONFIGS, RECURRENT, tiny_model
from tests.support import assert_lossless, FakeTokenizer, reference_greedy
from tests.support import whole_sampling as whole

VOCAB = CONFIGS["llama_tied"]["vocab_size"]
HALF = KeptIds.of(range(8, 56), VOCAB)  # the tiny families' kept ids: half of them, and of each family's greedy ones
PROMPTS = [[7, 30], [90, 3, 3, 17, 52, 8, 71, 29, 64, 11, 6]]
TOKENS = 16
DEMO_V = 64  # of the demo's 512 ids


# --- which ids ---------------------------------------------------------------------------------------------


def test_the_kept_ids_are_v_of_the_shipped_texts_ids_with_eos_and_specials_the_same_every_time():
    tokenizer = folder_tokenizer(demo_pair.DRAFT)
    kept = kept_ids(tokenizer, DEMO_V, 512)
    ids = kept.ids.tolist()
    assert len(kept) == DEMO_V and ids == sorted(ids)
    assert set(tokenizer.eos_token_ids) | set(tokenizer.all_special_ids) <= set(ids)
    assert kept == kept_ids(tokenizer, DEMO_V, 512)  # deterministic
    counts = draft_vocab.token_counts(tokenizer, 512)
    others = [i for i in ids if i not in draft_vocab.always_kept(tokenizer)]
    assert min(counts[others]) >= max(np.delete(counts, ids)), "a kept id is rarer than one left out"


def test_ties_go_to_the_lower_id_and_the_always_kept_come_first():
    counts = np.array([1, 4, 4, 0, 4, 2])
    assert draft_vocab.most_counted(counts, 2).tolist() == [1, 2]
    assert draft_vocab.most_counted(counts, 3, always=[3]).tolist() == [1, 2, 3]
    assert draft_vocab.most_counted(counts, 6, always=[3]).tolist() == [0, 1, 2, 3, 4, 5]
    assert draft_vocab.most_counted(counts, 1, always=[5, 3]).tolist() == [5]


@pytest.mark.parametrize("family,quantized", [("llama_tied", False), ("llama_untied", False), ("llama_tied", True),
                                              ("llama_untied", True)])
def test_the_trimmed_heads_logits_are_the_whole_heads_on_the_kept_ids_and_minus_infinity_elsewhere(family, quantized):
    """A tied or own head, plain or quantized: the kept rows score as before, the others never win."""
    model = tiny_model(family, seed=3)
    if quantized:
        import mlx.nn as nn

        nn.quantize(model, group_size=32, bits=8)
    tokens = mx.array([[5, 61, 2, 88]])
    whole = np.array(model(tokens))
    trimmed = np.array(trim(model, HALF)(tokens))
    on = HALF.ids
    assert np.allclose(trimmed[..., on], whole[..., on], atol=1e-4)
    assert np.isneginf(np.delete(trimmed, on, axis=-1)).all()
    assert model.kept_size == len(HALF) == 48


# --- greedy: mlx-lm's tokens in every family ----------------------------------------------------------------


@pytest.mark.parametrize("family", CACHE_FAMILIES + list(RECURRENT))
def test_a_trimmed_draft_gives_mlx_lm_greedy_in_every_family(family):
    """The target's own copy as draft, half its ids kept: windows accepted where the target's token is kept,
    rejected where it is not (both happen in every family); sd and mirror return mlx-lm's greedy tokens."""
    target = tiny_model(family, seed=21)
    pipe = Pipeline(target, FakeTokenizer(VOCAB), MLXDraft(trim(tiny_model(family, seed=21), HALF)))
    accepted = rejections = 0
    try:
        for prompt in PROMPTS:
            ref = reference_greedy(target, prompt, TOKENS)
            for mode in ("sd", "mirror"):
                out = pipe.generate(prompt, max_tokens=TOKENS, mode=mode, kappa=3, gamma=4, exit_layer=2,
                                    branches=15 if mode == "mirror" else None, stop=False)
                assert out.stats.mode == mode and out.stats.draft_failure is None, out.stats.draft_failure
                assert_lossless(out.tokens, ref, f"{family} {mode}: prompt {prompt} gave {out.tokens}, mlx-lm {ref}")
                assert out.stats.draft_vocab == len(HALF)
                accepted, rejections = accepted + out.stats.accepted, rejections + out.stats.rejections
    finally:
        pipe.close()
    assert accepted > 0 and rejections > 0, (family, accepted, rejections)


@pytest.fixture(scope="module")
def demo():
    """The demo pair loaded with draft_vocab (its draft trimmed in its own host process)."""
    pipe = mirror_mlx.load(draft_vocab=DEMO_V)
    yield pipe
    pipe.close()


def test_the_demo_pair_trimmed_through_load_gives_mlx_lm_greedy_and_says_so(demo):
    prompt = demo.encode("Once upon a time")
    ref = reference_greedy(demo.model, prompt, 32)
    for mode in ("sd", "mirror"):
        out = demo.generate(prompt, max_tokens=32, mode=mode, kappa=4, gamma=5, stop=False)
        assert_lossless(out.tokens, ref, mode)
        assert 0 < out.stats.accepted < out.stats.proposed, out.stats.summary()
        assert out.stats.draft_vocab == DEMO_V and f"draft vocab {DEMO_V}" in out.stats.summary()
    assert demo.generate(prompt, max_tokens=4, mode="ar").stats.summary().count("draft vocab") == 0


def test_a_trimmed_ss_draft_gives_the_targets_greedy_tokens(demo):
    tokenizer = folder_tokenizer(demo_pair.SS_DRAFT)
    ss = SSDraft.from_path(demo_pair.SS_DRAFT)
    trim(ss.model, kept_ids(tokenizer, DEMO_V, 512))
    pipe = Pipeline(demo.model, demo.tokenizer, ss)
    try:
        prompt = demo.encode("The dog ran")
        ref = reference_greedy(demo.model, prompt, 24)
        for mode in ("sd", "mirror"):
            out = pipe.generate(prompt, max_tokens=24, mode=mode, kappa=2, gamma=4, stop=False)
            assert_lossless(out.tokens, ref, mode)
            assert out.stats.draft_vocab == DEMO_V, mode
    finally:
        pipe.close()


# --- temperature 1 -------------------------------------------------------------------------------------------


def test_a_seeded_sample_is_the_same_in_every_mode(demo):
    kw = dict(max_tokens=24, temperature=1.0, seed=3, stop=False)
    ar = demo.generate("Once upon a time", mode="ar", **kw).tokens
    for mode in ("sd", "mirror"):
        assert_lossless(demo.generate("Once upon a time", mode=mode, kappa=4, gamma=5, **kw).tokens, ar, mode)


def test_every_committed_token_follows_the_target_distribution_when_the_draft_keeps_3_of_8_ids():
    """test_sampling_whole's check with a trimmed draft: the target's own token, where the draft cannot propose
    it (a third of the tokens here or more), is still drawn from the target's distribution."""
    kept = KeptIds.of([0, 1, 2], whole.V)
    target = tiny_model("llama_tied", seed=11, **whole.SHAPE)
    draft = trim(tiny_model("llama_tied", seed=11, **whole.SHAPE), kept)
    pipe = Pipeline(target, FakeTokenizer(whole.V), MLXDraft(draft))
    try:
        p, seen = whole.sample(target, pipe, "mirror", whole.SETTINGS["temperature"], whole.SEEDS["mirror"])
        chunks = [c for s in range(5) for c in pipe.stream(whole.PROMPT, max_tokens=whole.TOKENS, temperature=1.0,
                                                             seed=s, mode="mirror", stop=False)]
    finally:
        pipe.close()
    whole.check_steps("mirror", seen)
    committed = [(t, drafted) for c in chunks for t, drafted in zip(c.tokens, c.from_draft)]
    assert all(t in kept.ids for t, drafted in committed if drafted), "the draft proposed an id it does not keep"
    outside = np.mean([t not in kept.ids for t, _ in committed])
    assert outside > 1 / 3, f"the draft could propose almost every token ({outside:.2f} outside)"
    assert min(p.values()) > whole.SEEDED_P, f"committed tokens do not follow the target ({p}, {seen})"


# --- bad input --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value,error", [(0, validate.BadValue), (-5, validate.BadValue), (513, validate.BadValue),
                                         (2.5, validate.BadType), ("64", validate.BadType)])
def test_a_bad_v_is_one_sentence_naming_draft_vocab(value, error):
    tokenizer = folder_tokenizer(demo_pair.DRAFT)
    with pytest.raises(error) as e:
        validate.draft_vocab(value, True)
        trimmed_head(demo_pair.DRAFT, tokenizer, value)  # (the vocabulary's bound: 512)
    assert e.value.param == "draft_vocab" and str(e.value).startswith("draft_vocab must be")
    assert "\n" not in str(e.value) and str(e.value).count(". ") == 0


def test_v_as_large_as_the_vocabulary_keeps_the_whole_head():
    assert trimmed_head(demo_pair.DRAFT, folder_tokenizer(demo_pair.DRAFT), 512) == ()


def test_draft_vocab_without_a_draft_model_or_with_a_core_ml_package_is_refused():
    for kwargs in (dict(model=demo_pair.TARGET), dict(draft_model="lookup")):
        with pytest.raises(validate.BadValue, match="no draft model") as e:
            mirror_mlx.load(draft_vocab=DEMO_V, **kwargs)
        assert e.value.param == "draft_vocab"
    with pytest.raises(validate.BadValue, match="Core ML package") as e:
        load_draft("draft.mlpackage", None, DEMO_V)
    assert e.value.param == "draft_vocab"


@pytest.mark.parametrize("args,said", [
    (["--draft-vocab", "0"], "--draft-vocab must be at least 1 (got 0)"),
    (["--draft-vocab", "600"], "--draft-vocab must be at most 512 (got 600)"),
    (["--model", str(demo_pair.TARGET), "--draft-vocab", "8"], "--draft-vocab trims a draft model's head"),
    (["--draft-vocab", "x"], "Invalid value for '--draft-vocab'"),
])
def test_the_command_line_says_it_in_one_line_naming_the_flag(args, said):
    result = CliRunner().invoke(main, ["generate", "-m", "4", *args])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and said in errors[0], result.output
