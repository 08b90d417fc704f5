"""mlx-lm users feel at home: `mirror_mlx.stream_generate` / `generate` drop in for mlx_lm's (a
`prompt_cache=` list included), `load()` takes mlx_lm.load's options and refuses unknown ones, and a
templated prompt is never templated twice.

Everything runs the embedded demo pair (stories260K target, llama2xs draft, one real tokenizer).
"""

import contextlib
import io
import json
import shutil

import mlx.core as mx
import pytest
from mlx_lm import generate as mlx_generate
from mlx_lm import load as mlx_load
from mlx_lm import stream_generate as mlx_stream_generate
from mlx_lm.generate import GenerationResponse
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_sampler

import mirror_mlx
from mirror_mlx import mlx_lm_api
from mirror_mlx.pipeline import load
from mirror_mlx.engine.recurrent import held
from tests.models import DRAFT_PATH, TARGET_PATH, lora_adapter, tiny_model

SCRIPT = """
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler

model, tokenizer = load(TARGET)
draft_model, _ = load(DRAFT)
for response in stream_generate(model, tokenizer, "Once upon a time", max_tokens=40, draft_model=draft_model,
                                sampler=make_sampler(0.0)):
    print(response.text, end="", flush=True)
print()
print(response.finish_reason, response.generation_tokens, response.prompt_tokens)
"""


@pytest.fixture(scope="module")
def pair():
    model, tokenizer = mlx_load(str(TARGET_PATH))
    draft, _ = mlx_load(str(DRAFT_PATH))
    return model, tokenizer, draft


def run(script: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(script, {"TARGET": str(TARGET_PATH), "DRAFT": str(DRAFT_PATH)})
    return out.getvalue()


def swapped(script: str) -> str:
    ours = script.replace("from mlx_lm import load, stream_generate",
                          "from mlx_lm import load\nfrom mirror_mlx import stream_generate")
    assert ours != script
    return ours


def test_swapping_the_import_gives_the_same_output():
    """An mlx-lm script with `from mirror_mlx import stream_generate` prints exactly what it printed."""
    expected = run(SCRIPT)
    assert expected.splitlines()[-1] == "length 40 5"
    assert run(swapped(SCRIPT)) == expected


def test_the_swapped_script_samples_the_same_text_in_every_mode_with_a_seed():
    """The same script at T > 0 with a seed (and a mode) added: ar, sd and mirror print the same sample."""
    sampled = swapped(SCRIPT).replace("sampler=make_sampler(0.0)", "sampler=make_sampler(0.8, top_p=0.95), seed=3, "
                                      "mode=MODE")
    texts = {mode: run(sampled.replace("MODE", repr(mode))) for mode in ("ar", "sd", "mirror")}
    assert texts["ar"] == texts["sd"] == texts["mirror"] != run(SCRIPT)


@pytest.mark.parametrize("mode", ["ar", "sd", "mirror"])
def test_same_tokens_as_mlx_lm_at_temperature_zero(pair, mode):
    model, tokenizer, draft = pair
    theirs = [r.token for r in mlx_stream_generate(model, tokenizer, "The dog", max_tokens=30)]
    ours = list(mirror_mlx.stream_generate(model, tokenizer, "The dog", max_tokens=30, draft_model=draft,
                                           mode=mode, kappa=4, gamma=4))
    assert [r.token for r in ours] == theirs
    assert all(isinstance(r, GenerationResponse) for r in ours)
    assert [r.generation_tokens for r in ours] == list(range(1, 31))
    assert [r.finish_reason for r in ours] == [None] * 29 + ["length"]
    assert ours[-1].stats is not None and ours[-1].stats.mode == mode
    assert any(r.from_draft for r in ours) == (mode != "ar")
    assert ours[0].prompt_tokens == len(tokenizer.encode("The dog")) and ours[-1].peak_memory > 0


@pytest.mark.parametrize("draft_model,lookup", [("lookup", None), ("draft", True)])
def test_the_lookup_gives_mlx_lm_s_tokens(pair, draft_model, lookup):
    """stream_generate with draft_model="lookup" (no draft model) or lookup=True beside the draft."""
    model, tokenizer, draft = pair
    prompt = "The dog ran to the park. The dog ran to the park. The dog"
    theirs = [r.token for r in mlx_stream_generate(model, tokenizer, prompt, max_tokens=30)]
    ours = list(mirror_mlx.stream_generate(model, tokenizer, prompt, max_tokens=30, mode="sd", gamma=4,
                                           draft_model=draft if draft_model == "draft" else draft_model,
                                           lookup=lookup))
    assert [r.token for r in ours] == theirs
    assert ours[-1].stats.lookup and ours[-1].stats.lookup_windows > 0


def test_the_recycled_draft_gives_mlx_lm_s_tokens(pair):
    """stream_generate with draft_model="recycle": no draft model, the target's own predictions as a tree."""
    model, tokenizer, _ = pair
    for prompt in ("The dog ran to the park. The dog ran to the park. The dog", "Once upon a time"):
        theirs = [r.token for r in mlx_stream_generate(model, tokenizer, prompt, max_tokens=30)]
        ours = list(mirror_mlx.stream_generate(model, tokenizer, prompt, max_tokens=30, draft_model="recycle"))
        assert [r.token for r in ours] == theirs and ours[-1].stats.recycle == "tree"


def test_seeded_samples_are_the_same_in_every_mode(pair):
    """mlx-lm's own sampler and a logits processor, T > 0, one seed: ar, sd and mirror agree token for token."""
    model, tokenizer, draft = pair
    ban = tokenizer.encode("Lily", add_special_tokens=False)[0]

    def no_lily(tokens, logits):
        return logits.at[:, ban].add(-1e9)

    runs = {mode: [r.token for r in mirror_mlx.stream_generate(
        model, tokenizer, "Once upon a time", max_tokens=32, draft_model=draft, mode=mode, seed=7, kappa=4, gamma=4,
        sampler=make_sampler(0.9, top_k=30), logits_processors=[no_lily])] for mode in ("ar", "sd", "mirror")}
    assert runs["ar"] == runs["sd"] == runs["mirror"]
    assert ban not in runs["ar"]


def test_generate_returns_mlx_lm_text_and_prints_its_verbose_lines(pair):
    model, tokenizer, draft = pair
    from mlx_lm import generate as mlx_generate

    expected = mlx_generate(model, tokenizer, "Tom and Lily", max_tokens=20)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        text = mirror_mlx.generate(model, tokenizer, "Tom and Lily", max_tokens=20, draft_model=draft, verbose=True)
    assert text == expected
    printed = out.getvalue()
    assert text in printed and "Prompt: 5 tokens" in printed and "Generation: 20 tokens" in printed


def test_an_end_of_sequence_token_ends_with_a_stop_record(tmp_path):
    model, tokenizer = mlx_load(str(TARGET_PATH))
    draft, _ = mlx_load(str(DRAFT_PATH))
    tokenizer.add_eos_token(".")  # as --extra-eos-token does
    theirs = list(mlx_stream_generate(model, tokenizer, "Once upon a time", max_tokens=60))
    ours = list(mirror_mlx.stream_generate(model, tokenizer, "Once upon a time", max_tokens=60, draft_model=draft))
    assert [r.token for r in ours] == [r.token for r in theirs]
    assert "".join(r.text for r in ours) == "".join(r.text for r in theirs)
    assert ours[-1].finish_reason == theirs[-1].finish_reason == "stop"
    assert ours[-1].generation_tokens == theirs[-1].generation_tokens < 60


def test_one_pipeline_per_model_pair(pair):
    model, tokenizer, draft = pair
    first = mlx_lm_api.pipeline(model, tokenizer, draft)
    assert mlx_lm_api.pipeline(model, tokenizer, draft) is first
    assert mlx_lm_api.pipeline(model, tokenizer, None) is not first


def test_a_mirror_mlx_draft_drives_the_stream_and_anything_else_is_refused(pair):
    """draft_model may be a mirror_mlx Draft (here an MLXDraft of the draft model): mlx-lm's greedy tokens."""
    from mirror_mlx.drafts.mlx_draft import MLXDraft

    model, tokenizer, draft = pair
    theirs = [r.token for r in mlx_stream_generate(model, tokenizer, "Once upon a time", max_tokens=20)]
    ours = mirror_mlx.stream_generate(model, tokenizer, mx.array(tokenizer.encode("Once upon a time")),
                                      max_tokens=20, draft_model=MLXDraft(draft))
    assert [r.token for r in ours] == theirs
    with pytest.raises(TypeError, match="draft_model must be an mlx-lm model, a mirror_mlx Draft"):
        next(mirror_mlx.stream_generate(model, tokenizer, "Hi", draft_model=3))


def test_unsupported_mlx_lm_arguments_are_refused_with_the_alternative(pair):
    model, tokenizer, draft = pair
    with pytest.raises(ValueError, match="max_kv_size 8 is smaller than the prompt"):
        next(mirror_mlx.stream_generate(model, tokenizer, "Hi", max_tokens=10, draft_model=draft, max_kv_size=8))
    assert len(list(mirror_mlx.stream_generate(model, tokenizer, "Hi", max_tokens=10, draft_model=draft,
                                               max_kv_size=64))) == 10
    with pytest.raises(ValueError, match="kv_bits=4: a quantized KV cache is not supported"):
        next(mirror_mlx.stream_generate(model, tokenizer, "Hi", draft_model=draft, kv_bits=4))
    with pytest.raises(TypeError, match="does not take kv_bitz"):
        next(mirror_mlx.stream_generate(model, tokenizer, "Hi", draft_model=draft, kv_bitz=4))
    assert len(list(mirror_mlx.stream_generate(model, tokenizer, "Hi", max_tokens=6, draft_model=draft,
                                               num_draft_tokens=2))) == 6  # mlx-lm's window is γ
    with pytest.raises(TypeError, match="mlx-lm model"):
        next(mirror_mlx.stream_generate(str(TARGET_PATH), tokenizer, "Hi"))


def test_mlx_lm_s_prefill_and_kv_arguments_are_taken_as_scripts_pass_them(pair):
    """prefill_step_size (prompt tokens per forward), kv_group_size / quantized_kv_start (no effect without
    kv_bits, as in mlx-lm) change no token, and prompt_progress_callback is called as mlx-lm calls it, chunk by chunk."""
    model, tokenizer, draft = pair
    prompt = "Once upon a time, Tom and Lily went to the park"
    theirs = []
    expected = [r.token for r in mlx_stream_generate(model, tokenizer, prompt, max_tokens=12, prefill_step_size=3,
                                                     prompt_progress_callback=lambda *c: theirs.append(c))]
    calls = []
    got = [r.token for r in mirror_mlx.stream_generate(
        model, tokenizer, prompt, max_tokens=12, draft_model=draft, kappa=4, gamma=4, prefill_step_size=3,
        kv_group_size=32, quantized_kv_start=4, prompt_progress_callback=lambda done, total: calls.append((done, total)))]
    assert got == expected
    n = len(tokenizer.encode(prompt))
    assert calls[0] == theirs[0] == (0, n) and calls[-1] == theirs[-1] == (n, n)
    done = [d for d, _ in calls]  # then after every chunk of at most 3 (tokens a cache already held count as done)
    assert len(calls) > 3 and all(0 < b - a <= 3 for a, b in zip(done[1:-2], done[2:-1]))
    with pytest.raises(ValueError, match="prefill_step_size must be at least 1"):
        next(mirror_mlx.stream_generate(model, tokenizer, prompt, draft_model=draft, prefill_step_size=0))


def test_an_xtc_sampler_from_make_sampler_samples_the_same_tokens_in_every_mode(pair):
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer, draft = pair
    runs = {mode: [r.token for r in mirror_mlx.stream_generate(
        model, tokenizer, "Once upon a time", max_tokens=24, draft_model=draft, mode=mode, seed=5, kappa=4, gamma=4,
        sampler=make_sampler(1.0, xtc_probability=0.5, xtc_threshold=0.05))] for mode in ("ar", "sd", "mirror")}
    assert runs["ar"] == runs["sd"] == runs["mirror"]


# --- prompt_cache=: mlx-lm's make_prompt_cache list, extended in place ------------------------------

TURNS = ["Once upon a time", " Tom went to the park.", " Then Lily said"]  # each turn: only its new text


def offsets(cache):
    return [c.offset for c in cache]


def turn(cache, text, mode=None, pair=None, **kwargs):
    """One turn on `cache`: mlx-lm's own stream_generate (mode None) or ours; the tokens, then the offset."""
    model, tokenizer, draft = pair
    if mode is None:
        records = mlx_stream_generate(model, tokenizer, text, max_tokens=12, prompt_cache=cache, **kwargs)
    else:
        records = mirror_mlx.stream_generate(model, tokenizer, text, max_tokens=12, draft_model=draft, mode=mode,
                                             kappa=4, gamma=4, prompt_cache=cache, **kwargs)
    return [r.token for r in records], held(cache)


@pytest.fixture(scope="module")
def mlx_lm_turns(pair):
    """mlx-lm's conversation over TURNS on its own make_prompt_cache: per turn (tokens, offset), and the cache."""
    cache = make_prompt_cache(pair[0])
    return [turn(cache, text, pair=pair) for text in TURNS], cache


@pytest.mark.parametrize("mode", ["ar", "sd", "mirror"])
def test_a_prompt_cache_carries_a_conversation_exactly_as_in_mlx_lm(pair, mlx_lm_turns, mode):
    """Every turn gives mlx-lm's tokens, and leaves the cache as mlx-lm's: the prompt and every generated
    token (the last included) appended, the same keys and values."""
    model, tokenizer, draft = pair
    expected, their_cache = mlx_lm_turns
    cache = make_prompt_cache(model)
    for text, (tokens, offset) in zip(TURNS, expected):
        assert turn(cache, text, mode, pair) == (tokens, offset)
        assert offsets(cache) == [offset] * len(cache)
    for ours, theirs in zip(cache, their_cache):
        k, v = ours.keys_and_values()
        tk, tv = theirs.keys_and_values()
        assert mx.allclose(k, tk, atol=1e-4) and mx.allclose(v, tv, atol=1e-4)
    # the draft read the cached turns' ids (they were ours): it still proposes tokens
    last = list(mirror_mlx.stream_generate(model, tokenizer, " and", max_tokens=12, draft_model=draft, mode=mode,
                                           kappa=4, gamma=4, prompt_cache=cache))
    assert any(r.from_draft for r in last) == (mode != "ar")
    assert last[0].prompt_tokens == len(tokenizer.encode(" and"))  # mlx-lm's count: the new text only


@pytest.mark.parametrize("mode", ["ar", "mirror"])
def test_a_prompt_cache_of_a_recurrent_target_carries_a_conversation_as_in_mlx_lm(pair, mode):
    """The same on a target with recurrent state (qwen3_next): its make_prompt_cache list's ArraysCache layers
    are made droppable in the caller's list, every turn gives mlx-lm's tokens on mlx-lm's own cache."""
    _, tokenizer, draft = pair
    model = tiny_model("qwen3_next", seed=21, vocab_size=512)
    recurrent_pair = (model, tokenizer, draft)
    theirs, ours = make_prompt_cache(model), make_prompt_cache(model)
    for text in TURNS:
        assert turn(ours, text, mode, recurrent_pair) == turn(theirs, text, pair=recurrent_pair), text


def test_after_a_prompt_cache_call_the_engine_keeps_its_own_cache(pair):
    """No aliasing: later calls without prompt_cache neither extend the caller's cache nor continue it;
    as in mlx-lm, max_kv_size is ignored when a prompt_cache is given."""
    model, tokenizer, draft = pair
    cache = make_prompt_cache(model)
    turn(cache, "Once upon a time", "mirror", pair, max_kv_size=8)  # (alone, 8 would be refused: too small)
    held = offsets(cache)
    keys = mx.array(cache[0].keys_and_values()[0])
    alone = [r.token for r in mirror_mlx.stream_generate(model, tokenizer, "The dog", max_tokens=12,
                                                         draft_model=draft)]
    assert offsets(cache) == held and mx.array_equal(cache[0].keys_and_values()[0], keys)
    assert alone == [r.token for r in mlx_stream_generate(model, tokenizer, "The dog", max_tokens=12)]


def test_stopping_early_leaves_what_was_yielded_as_mlx_lm_does(tmp_path):
    """The caller leaves the loop after 3 records, mid-step: the cache holds the prompt and those 3 tokens,
    as mlx-lm's, so the next turn gives mlx-lm's tokens; an end-of-sequence token stays in it too."""
    model, tokenizer = mlx_load(str(TARGET_PATH))
    draft, _ = mlx_load(str(DRAFT_PATH))
    tokenizer.add_eos_token(".")  # the second turn ends at "."
    pair = (model, tokenizer, draft)
    caches = {"mlx-lm": make_prompt_cache(model), "mirror": make_prompt_cache(model)}
    for who, cache in caches.items():
        records = (mlx_stream_generate(model, tokenizer, "Once upon a time", max_tokens=40, prompt_cache=cache)
                   if who == "mlx-lm" else
                   mirror_mlx.stream_generate(model, tokenizer, "Once upon a time", max_tokens=40, draft_model=draft,
                                              kappa=4, gamma=4, prompt_cache=cache))
        for n, r in enumerate(records, 1):
            if n == 3:  # (mirror commits 5 tokens in its first step here)
                break
        records.close()  # (as leaving the loop does once the generator is dropped)
        assert cache[0].offset == len(tokenizer.encode("Once upon a time")) + 3
    ends = {who: list(mirror_mlx.stream_generate(model, tokenizer, " Tom", max_tokens=40, draft_model=draft,
                                                   prompt_cache=cache)) if who == "mirror" else
            list(mlx_stream_generate(model, tokenizer, " Tom", max_tokens=40, prompt_cache=cache))
            for who, cache in caches.items()}
    assert [r.token for r in ends["mirror"]] == [r.token for r in ends["mlx-lm"]]
    assert ends["mirror"][-1].finish_reason == "stop" and caches["mirror"][0].offset == caches["mlx-lm"][0].offset
    assert turn(caches["mirror"], " Then", "mirror", pair) == turn(caches["mlx-lm"], " Then", pair=pair)


def test_after_an_error_the_cache_holds_a_prefix_of_the_records_and_stays_usable(pair):
    """A logits processor raises mid-generation: the error reaches the caller, the cache holds the prompt
    and a prefix of the yielded tokens (every layer alike), and the next turn, in mirror mode still, gives
    what mlx-lm gives on a cache of those same tokens."""
    from mlx_lm.generate import generate_step

    model, tokenizer, draft = pair
    calls = []

    def fails_late(tokens, logits):
        calls.append(1)
        if len(calls) == 12:
            raise RuntimeError("processor failed")
        return logits

    cache, records = make_prompt_cache(model), []
    prompt = tokenizer.encode("Once upon a time")
    with pytest.raises(RuntimeError, match="processor failed"):
        for r in mirror_mlx.stream_generate(model, tokenizer, prompt, max_tokens=40, draft_model=draft, kappa=4,
                                            gamma=4, prompt_cache=cache, logits_processors=[fails_late]):
            records.append(r.token)
    assert records and len(set(offsets(cache))) == 1
    assert len(prompt) <= cache[0].offset <= len(prompt) + len(records)
    held = (prompt + records)[: cache[0].offset]
    theirs = make_prompt_cache(model)
    for _ in generate_step(mx.array(held), model, max_tokens=0, prompt_cache=theirs):  # (mlx_lm.cache_prompt's way)
        pass
    assert turn(cache, " Then", "mirror", pair) == turn(theirs, " Then", pair=pair)


def test_a_cache_that_mlx_lm_filled_continues_in_ar_and_the_draft_modes_name_the_fix(pair):
    """mlx-lm keeps no token ids: its prefix is opaque to the draft, so ar continues it (exactly as
    mlx-lm does) and sd/mirror refuse in one sentence."""
    model, tokenizer, draft = pair
    ours, theirs = make_prompt_cache(model), make_prompt_cache(model)
    for cache in (ours, theirs):
        turn(cache, TURNS[0], pair=pair)  # mlx-lm fills both
    for mode in ("sd", "mirror"):
        with pytest.raises(ValueError, match=f"mode '{mode}' needs the cached prompt's token ids .*mlx-lm filled it"
                                             ".* or use mode='ar'"):
            turn(ours, TURNS[1], mode, pair)
    assert offsets(ours) == offsets(theirs)  # refused before any work
    for text in TURNS[1:]:
        assert turn(ours, text, "ar", pair) == turn(theirs, text, pair=pair)


def test_a_rotating_cache_serves_ar_only_and_another_model_s_cache_is_refused(pair):
    """A rotating cache (what make_prompt_cache(model, max_kv_size=24) makes for a model without its own
    make_cache; the demo target has one) cannot roll back draft tokens: ar continues it as mlx-lm does,
    past its size too; mirror refuses. A cache of another shape is refused before any work."""
    model, tokenizer, draft = pair
    rotating, theirs = ([RotatingKVCache(max_size=24, keep=4) for _ in model.layers] for _ in range(2))
    with pytest.raises(ValueError, match="holds RotatingKVCache layers, which cannot roll back rejected draft "
                                         "tokens: use mode='ar'"):
        turn(rotating, TURNS[0], "mirror", pair)
    for text in TURNS:
        assert turn(rotating, text, "ar", pair) == turn(theirs, text, pair=pair)
    with pytest.raises(ValueError, match="holds 3 layers but the target has 5: it was made for another model") as e:
        turn(make_prompt_cache(model)[:3], TURNS[0], "ar", pair)
    assert e.value.param == "prompt_cache"  # what the command line names as --prompt-cache-file
    with pytest.raises(ValueError, match="holds 10 layers .*give make_prompt_cache\\(model\\) of the target alone"):
        turn(make_prompt_cache(model) + make_prompt_cache(draft), TURNS[0], "mirror", pair)  # mlx-lm's speculative list
    with pytest.raises(ValueError, match="prompt_cache must be the list .*make_prompt_cache\\(model\\) returns"):
        turn([], TURNS[0], "ar", pair)


@pytest.mark.parametrize("kwargs, name", [(dict(draft="x"), "draft"), (dict(modle="x"), "modle")])
def test_load_refuses_unknown_arguments_by_name(kwargs, name):
    for loader in (load, mirror_mlx.load):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
            loader(**kwargs)


def test_adapter_path_applies_lora_to_the_target_as_mlx_lm_does(tmp_path):
    adapter = lora_adapter(tmp_path / "adapter")
    model, tokenizer = mlx_load(str(TARGET_PATH), adapter_path=str(adapter))
    theirs = [r.token for r in mlx_stream_generate(model, tokenizer, "Once upon a time", max_tokens=24)]
    plain, _ = mlx_load(str(TARGET_PATH))
    assert theirs != [r.token for r in mlx_stream_generate(plain, tokenizer, "Once upon a time", max_tokens=24)]
    pipe = load(TARGET_PATH, DRAFT_PATH, adapter_path=adapter)
    try:
        for mode in ("ar", "mirror"):
            assert pipe.generate("Once upon a time", max_tokens=24, mode=mode, kappa=4, gamma=4,
                                 stop=False).tokens == theirs
    finally:
        pipe.close()
    with pytest.raises(ValueError, match="adapter_path .* is not a folder"):
        load(TARGET_PATH, adapter_path=tmp_path / "missing")


def templated_copy(tmp_path):
    folder = tmp_path / "templated"
    shutil.copytree(TARGET_PATH, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                            "{% if add_generation_prompt %}assistant: {% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def test_a_templated_prompt_is_not_templated_again(tmp_path):
    pipe = load(templated_copy(tmp_path), exit_adapter="none")
    try:
        tok = pipe.tokenizer
        messages = [{"role": "user", "content": "Tell a story"}]
        once = tok.apply_chat_template(messages, add_generation_prompt=True)
        assert pipe.encode("Tell a story") == once  # Pipeline's convenience: plain text gets the template
        templated = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert pipe.encode(templated) == once  # the caller templated it: as is
        model, tokenizer = pipe.model, pipe.tokenizer
        ours = list(mirror_mlx.stream_generate(model, tokenizer, templated, max_tokens=8))
        theirs = list(mlx_stream_generate(model, tokenizer, templated, max_tokens=8))
        assert [r.token for r in ours] == [r.token for r in theirs]
    finally:
        pipe.close()


def test_a_text_prompt_is_taken_as_is_by_the_pipeline_as_by_mlx_lms_generate(tmp_path):
    """One rule for text: Pipeline.generate and mirror_mlx.generate encode it as mlx-lm's generate does, with no
    chat template (Pipeline.chat puts messages through it)."""
    pipe = load(templated_copy(tmp_path), exit_adapter="none")
    try:
        model, tokenizer = pipe.model, pipe.tokenizer
        assert pipe.plan("Tell a story").ids == tokenizer.encode("Tell a story")
        theirs = mlx_generate(model, tokenizer, "Tell a story", max_tokens=8)
        assert mirror_mlx.generate(model, tokenizer, "Tell a story", max_tokens=8) == theirs
        assert pipe.generate("Tell a story", max_tokens=8, mode="ar").text == theirs
    finally:
        pipe.close()
