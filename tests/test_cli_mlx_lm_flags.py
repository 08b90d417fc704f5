"""`mirror-mlx generate` takes mlx_lm.generate's flags, flag by flag, and does what mlx-lm's does.

Each row runs mlx-lm's own command line (`mlx_lm.generate.main`, in process, `--verbose False`: it
prints only the text) and ours (`--quiet`: the same) with the same flags, on the demo target (or a
copy of it with a small chat template), and compares the printed text. Rows that cannot be compared
that way (sampling filters, refusals) check the effect itself.
"""

import contextlib
import io
import json
import shutil
import sys

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx_lm import load as mlx_load
from mlx_lm.cache_prompt import main as mlx_lm_cache_prompt_main
from mlx_lm.generate import main as mlx_lm_generate_main
from mlx_lm.sample_utils import apply_min_p

from mirror_mlx.cli import main
from tests.models import DRAFT_PATH, TARGET_PATH, lora_adapter
from tests.support import assert_lossless

TEMPLATE = ("{{ bos_token }}{% if greeting is defined %}{{ greeting }} {% endif %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("templated") / "stories260K-chat"
    shutil.copytree(TARGET_PATH, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=TEMPLATE)))
    return folder


def run_mlx_lm(command, *argv) -> str:
    """What one of mlx-lm's own command lines (its main()) prints, run in process with `argv`."""
    out = io.StringIO()
    saved = sys.argv
    sys.argv = ["mlx_lm", *argv]
    try:
        with contextlib.redirect_stdout(out):
            command()
    finally:
        sys.argv = saved
    return out.getvalue()


def mlx_lm_prints(*args) -> str:
    return run_mlx_lm(mlx_lm_generate_main, *args, "--verbose", "False")


PREFIX = "Once upon a time, Tom and Lily"  # the cached prefix of the --prompt-cache-file rows


@pytest.fixture(scope="module")
def cache_files(templated, tmp_path_factory):
    """Prompt cache files of PREFIX for the templated demo target: mlx-lm's (mlx_lm.cache_prompt's own
    code) and ours (`mirror-mlx cache-prompt`, mlx-lm's format plus the token ids)."""
    folder = tmp_path_factory.mktemp("prompt-cache")
    files = {"mlx-lm": str(folder / "mlx-lm.safetensors"), "ours": str(folder / "ours.safetensors")}
    run_mlx_lm(mlx_lm_cache_prompt_main, "--model", str(templated), "--prompt", PREFIX,
               "--prompt-cache-file", files["mlx-lm"])
    made = CliRunner().invoke(main, ["cache-prompt", "--model", str(templated), "--prompt", PREFIX,
                                     "--prompt-cache-file", files["ours"]])
    assert made.exit_code == 0, made.output
    return files


def ours(*args, mode="mirror"):
    knobs = [] if "--num-draft-tokens" in args else ["--gamma", "4"]
    return CliRunner().invoke(main, ["generate", "--mode", mode, "--draft-model", str(DRAFT_PATH), "--kappa", "4",
                                     *knobs, *args, "--verbose", "False"])


ROWS = {  # flag: (the model, extra flags); the prompt and --max-tokens 24 are added to both
    "--system-prompt": ("templated", ["--system-prompt", "You tell short stories."]),
    "--ignore-chat-template": ("templated", ["--ignore-chat-template"]),
    "--chat-template-config": ("templated", ["--chat-template-config", '{"greeting": "Hello there."}']),
    "--use-default-chat-template": ("templated", ["--use-default-chat-template"]),
    "--extra-eos-token": ("plain", ["--extra-eos-token", "."]),
    "--max-kv-size": ("plain", ["--max-kv-size", "256"]),
    "--trust-remote-code": ("plain", ["--trust-remote-code"]),
    "--top-k 1 at --temp 2": ("plain", ["--temp", "2.0", "--top-k", "1"]),
    "--extra-eos-token a b (argparse's nargs)": ("plain", ["--extra-eos-token", "▁in", "."]),
    "--prefill-response": ("templated", ["--prefill-response", "Once upon a time"]),
    "--prefill-step-size": ("plain", ["--prefill-step-size", "2"]),
    "--num-draft-tokens": ("plain", ["--num-draft-tokens", "2"]),
    "--kv-group-size / --quantized-kv-start (no effect without --kv-bits, as in mlx-lm)":
        ("plain", ["--kv-group-size", "32", "--quantized-kv-start", "8"]),
    "--xtc-probability at --temp 0 (greedy, as in mlx-lm)": ("plain", ["--xtc-probability", "1.0"]),
    # mlx-lm's file has no token ids for the draft: auto runs ar (said on stderr), as mlx-lm's generate
    "--prompt-cache-file (mlx_lm.cache_prompt's file)": ("templated", ["--prompt-cache-file", "<mlx-lm>"]),
    # ours adds the ids: the draft reads them, and mirror prints what mlx-lm's generate prints with it
    "--prompt-cache-file (mirror-mlx cache-prompt's file)": ("templated", ["--prompt-cache-file", "<ours>"]),
}
MODES = {"--prompt-cache-file (mlx_lm.cache_prompt's file)": "auto"}  # the rest: mirror


@pytest.mark.parametrize("flag", ROWS)
def test_flag_prints_what_mlx_lm_prints(flag, templated, request):
    which, extra = ROWS[flag]
    if "--prompt-cache-file" in extra:
        files = request.getfixturevalue("cache_files")
        extra = [files[a[1:-1]] if a.startswith("<") else a for a in extra]
    model = str(templated if which == "templated" else TARGET_PATH)
    args = ["--model", model, "--prompt", "Tom and Lily", "--max-tokens", "24", *extra]
    expected = mlx_lm_prints(*args)
    result = ours(*args, mode=MODES.get(flag, "mirror"))
    assert result.exit_code == 0, result.output
    assert result.stdout == expected


def test_the_template_flags_change_the_prompt(templated):
    """The rows above would pass vacuously if a flag changed nothing: each one changes mlx-lm's output."""
    base = ["--model", str(templated), "--prompt", "Tom and Lily", "--max-tokens", "24"]
    plain = mlx_lm_prints(*base)
    for flag in ("--system-prompt", "--ignore-chat-template", "--chat-template-config", "--prefill-response"):
        assert mlx_lm_prints(*base, *ROWS[flag][1]) != plain, flag
    plain_model = ["--model", str(TARGET_PATH), "--prompt", "Tom and Lily", "--max-tokens", "24"]
    one_eos = mlx_lm_prints(*plain_model, "--extra-eos-token", ".")
    assert mlx_lm_prints(*plain_model, *ROWS["--extra-eos-token a b (argparse's nargs)"][1]) != one_eos
    assert mlx_lm_prints("--model", str(TARGET_PATH), "--prompt", "Tom and Lily", "--max-tokens", "24",
                         "--extra-eos-token", ".").count(" ") < 12  # it stopped at the first full stop


def test_system_prompt_appears_in_the_templated_prompt(templated):
    from mirror_mlx.text import cli_prompt

    _, tokenizer = mlx_load(str(templated))
    text = tokenizer.decode(cli_prompt(tokenizer, "Tom and Lily", "You tell short stories.", True, {"greeting": "Hi."}))
    assert text.endswith("Hi. system: You tell short stories.\nuser: Tom and Lily\nassistant: ")


def test_adapter_path_prints_what_mlx_lm_prints(tmp_path):
    adapter = str(lora_adapter(tmp_path / "adapter"))
    args = ["--model", str(TARGET_PATH), "--prompt", "Tom and Lily", "--max-tokens", "24", "--adapter-path", adapter]
    result = ours(*args)
    assert result.exit_code == 0, result.output
    assert result.stdout == mlx_lm_prints(*args) != mlx_lm_prints(*args[:-2])


def test_default_max_tokens_is_mlx_lm_s_100():
    args = ["--model", str(TARGET_PATH), "--prompt", "Tom and Lily"]
    result = ours(*args, mode="sd")
    assert result.stdout == mlx_lm_prints(*args)
    model, tokenizer = mlx_load(str(TARGET_PATH))
    assert len(tokenizer.encode(result.stdout.strip(), add_special_tokens=False)) in range(95, 106)


def within_min_p(flags, min_p):
    """Run `generate --json` at --temp 5; is every token inside mlx-lm's min-p set of its row?"""
    result = CliRunner().invoke(main, ["generate", "--model", str(TARGET_PATH), "--prompt", "Tom and Lily", "--json",
                                       "--mode", "ar", "--temp", "5", "--seed", "1", "--max-tokens", "24", *flags])
    tokens = json.loads(result.stdout.strip().splitlines()[-1])["tokens"]
    model, tokenizer = mlx_load(str(TARGET_PATH))
    prompt = tokenizer.encode("Tom and Lily")
    logits = model(mx.array([prompt + tokens]))[0, len(prompt) - 1 : -1]
    allowed = apply_min_p(logits - mx.logsumexp(logits, axis=-1, keepdims=True), min_p) > -float("inf")
    return all(allowed[i, t].item() for i, t in enumerate(tokens))


def test_min_p_keeps_only_tokens_above_min_p_times_the_top_probability():
    """At --temp 5 almost any token could come; with --min-p 0.5 every one is within mlx-lm's min-p set."""
    assert within_min_p(["--min-p", "0.5"], 0.5)
    assert not within_min_p([], 0.5)  # without the flag, some are not


def within_xtc(flags, threshold):
    """Run `generate --json` at --temp 5; is every token one that mlx-lm's XTC (probability 1) leaves in its row?"""
    from mlx_lm.sample_utils import apply_xtc

    result = CliRunner().invoke(main, ["generate", "--model", str(TARGET_PATH), "--prompt", "Tom and Lily", "--json",
                                       "--mode", "ar", "--temp", "5", "--seed", "1", "--max-tokens", "24", *flags])
    assert result.exit_code == 0, result.output
    tokens = json.loads(result.stdout.strip().splitlines()[-1])["tokens"]
    model, tokenizer = mlx_load(str(TARGET_PATH))
    prompt = tokenizer.encode("Tom and Lily")
    logits = model(mx.array([prompt + tokens]))[0, len(prompt) - 1 : -1]
    special = tokenizer.encode("\n") + list(tokenizer.eos_token_ids)
    allowed = apply_xtc(logits - mx.logsumexp(logits, axis=-1, keepdims=True), 1.0, threshold, special) > -float("inf")
    return all(allowed[i, t].item() for i, t in enumerate(tokens))


def test_xtc_removes_the_likely_tokens_as_mlx_lm_s_sampler_does():
    assert within_xtc(["--xtc-probability", "1.0", "--xtc-threshold", "0.01"], 0.01)
    assert not within_xtc([], 0.01)  # without the flag, some tokens are ones XTC removes


def test_xtc_samples_the_same_text_in_every_mode():
    """XTC is part of the target's processed distribution: with a seed every mode commits the same tokens."""
    flags = ["--model", str(TARGET_PATH), "--prompt", "Tom and Lily", "--temp", "1.0", "--seed", "3",
             "--max-tokens", "32", "--xtc-probability", "0.5", "--xtc-threshold", "0.05"]
    texts = {mode: ours(*flags, mode=mode).stdout for mode in ("ar", "sd", "mirror")}
    assert texts["ar"] == texts["sd"] == texts["mirror"] != ours(*flags[:-4], mode="ar").stdout


@pytest.mark.parametrize("value, prints_stats", [("False", False), ("F", False), ("false", False),
                                                 ("True", True), ("T", True), ("yes", True)])
def test_verbose_takes_mlx_lm_s_values(value, prints_stats):
    """mlx-lm's str2bool: 'false' or 'f' (any case) is False, anything else True; the text is on stdout either way."""
    result = CliRunner().invoke(main, ["generate", "--prompt", "Tom and Lily", "--max-tokens", "8", "--verbose", value])
    assert result.exit_code == 0, result.output
    assert ("Generation: 8 tokens" in result.stderr) == prints_stats and result.stdout.strip()


def test_seed_gives_the_same_text_in_every_mode():
    texts = {mode: ours("--model", str(TARGET_PATH), "--prompt", "Tom and Lily", "--temp", "0.8", "--seed", "3",
                        "--max-tokens", "32", mode=mode).stdout for mode in ("ar", "sd", "mirror")}
    assert texts["ar"] == texts["sd"] == texts["mirror"]


def test_verbose_prints_mlx_lm_s_timing_lines_on_stderr():
    result = CliRunner().invoke(main, ["generate", "--prompt", "Tom and Lily", "--max-tokens", "12"])
    assert result.exit_code == 0
    assert "Prompt: 5 tokens" in result.stderr and "Generation: 12 tokens" in result.stderr
    assert "Peak memory:" in result.stderr and "accepted/forward" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--max-kv-size", "16"], "--max-kv-size 16 is smaller than the prompt (5 tokens) plus --max-tokens (24)"),
    (["--prompt-cache-file", "x.safetensors"], "--prompt-cache-file: prompt cache file x.safetensors does not exist"),
    (["--chat-template-config", "{enable"], "--chat-template-config is not valid JSON"),
    (["--extra-eos-token", "no-such-token"], "--extra-eos-token 'no-such-token' is not a token"),
    (["--adapter-path", "/no/such/adapter"], "--adapter-path '/no/such/adapter' is not a folder"),
    (["--kv-bits", "4"], "--kv-bits is refused: a quantized KV cache is not supported"),
    (["--image", "a.png", "b.png"], "--image is refused: mirror-mlx runs text models only"),
    (["--quantize-activations"], "--quantize-activations is refused"),
    (["--xtc-threshold", "0.7"], "--xtc-threshold must be in [0, 0.5]"),
    (["--prefill-step-size", "0"], "--prefill-step-size must be at least 1"),
])
def test_refusals_are_one_line_naming_the_flag(args, message):
    result = ours("--model", str(TARGET_PATH), "--prompt", "Tom and Lily", "--max-tokens", "24", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_a_missing_draft_names_the_flags():
    result = CliRunner().invoke(main, ["generate", "--model", str(TARGET_PATH), "--mode", "sd", "--max-tokens", "4"])
    assert result.exit_code == 2
    assert "--draft-model" in result.output and "--mode ar" in result.output and "draft_model=" not in result.output


def test_chat_takes_the_system_prompt_and_template_config(templated):
    """`chat --system-prompt --chat-template-config`: the first reply is mlx-lm's on that templated conversation."""
    from mlx_lm import generate as mlx_generate

    model, tokenizer = mlx_load(str(templated))
    messages = [{"role": "system", "content": "You tell short stories."}, {"role": "user", "content": "Tom and Lily"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, greeting="Hello there.")
    expected = mlx_generate(model, tokenizer, prompt, max_tokens=12)
    result = CliRunner().invoke(main, ["chat", "--model", str(templated), "--mode", "ar", "--max-tokens", "12",
                                       "--system-prompt", "You tell short stories.",
                                       "--chat-template-config", '{"greeting": "Hello there."}'], input="Tom and Lily\n")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == expected.strip()  # stdout holds only the reply


def mlx_lm_ids(*args) -> list:
    """The token ids mlx-lm's generate command line produces (its stream_generate's, recorded as it runs)."""
    mlx_lm_generate = sys.modules[mlx_lm_generate_main.__module__]  # (the package's `generate` is a function)
    ids, real = [], mlx_lm_generate.stream_generate

    def recording(*a, **k):
        for response in real(*a, **k):
            ids.append(response.token)
            yield response

    mlx_lm_generate.stream_generate = recording
    try:
        mlx_lm_prints(*args)
    finally:
        mlx_lm_generate.stream_generate = real
    return ids


def test_prompt_cache_files_give_mlx_lm_s_ids_in_every_mode(cache_files, templated):
    """With mlx_lm.cache_prompt's file, ar gives mlx-lm's ids; with ours, ar, sd and mirror give them too."""
    args = ["--model", str(templated), "--prompt", " went to the park", "--max-tokens", "32",
            "--system-prompt", "Be brief."]
    expected = mlx_lm_ids(*args, "--prompt-cache-file", cache_files["mlx-lm"])
    assert mlx_lm_ids(*args, "--prompt-cache-file", cache_files["ours"]) == expected  # mlx-lm reads ours as its own
    assert mlx_lm_ids(*args) != expected  # and the cached prefix matters
    for which, modes in (("mlx-lm", ("ar", "auto")), ("ours", ("ar", "sd", "mirror"))):
        for mode in modes:
            result = CliRunner().invoke(main, ["generate", *args, "--prompt-cache-file", cache_files[which], "--json",
                                               "--mode", mode, "--draft-model", str(DRAFT_PATH), "--kappa", "4",
                                               "--gamma", "4"])
            assert result.exit_code == 0, result.output
            out = json.loads(result.stdout.strip().splitlines()[-1])
            n = len(out["tokens"])  # (mlx-lm's ids end with the end-of-sequence token if one came)
            assert_lossless(out["tokens"], expected[:n], (which, mode))
            assert n >= len(expected) - 1, (which, mode)
            stats = out["stats"]
            if mode == "auto":  # ran ar, and said why
                assert stats["mode"] == "ar" and "no token ids" in stats["why"], stats
            elif mode != "ar":  # the draft's windows were partly accepted: the loaded cache was rolled back
                assert stats["mode"] == mode and 1 < stats["mean_accepted"] < 5, stats


def test_cache_prompt_writes_mlx_lm_s_file_plus_the_ids(cache_files):
    """The same keys and values and metadata as mlx_lm.cache_prompt's file, and the prefix's token ids."""
    from mlx_lm.models.cache import load_prompt_cache

    theirs, their_meta = load_prompt_cache(cache_files["mlx-lm"], return_metadata=True)
    ours_, our_meta = load_prompt_cache(cache_files["ours"], return_metadata=True)
    ids = json.loads(our_meta.pop("mirror_mlx_tokens"))
    assert our_meta == their_meta and len(ids) == theirs[0].offset == ours_[0].offset > 0
    for a, b in zip(theirs, ours_):
        assert type(a) is type(b) and all(mx.array_equal(x[:, :, : a.offset], y[:, :, : b.offset]).item()
                                          for x, y in zip(a.state[:2], b.state[:2]))


def test_an_mlx_lm_prompt_cache_file_refuses_the_draft_modes_in_one_line(cache_files, templated):
    for mode in ("sd", "mirror"):
        result = ours("--model", str(templated), "--prompt", "Tom", "--prompt-cache-file", cache_files["mlx-lm"],
                      mode=mode)
        assert result.exit_code == 2 and "Traceback" not in result.output
        assert f"mode '{mode}' needs the cached prompt's token ids" in result.output
        assert "mirror-mlx cache-prompt" in result.output and "--mode ar" in result.output
    result = ours("--model", str(TARGET_PATH), "--prompt", "Tom", "--prompt-cache-file", cache_files["ours"])
    assert result.exit_code == 2 and "is not the model that made --prompt-cache-file" in result.output


def test_the_pipeline_continues_a_prompt_cache_for_one_call_only(cache_files, templated):
    """Pipeline.generate(prompt_cache=...) continues the file's prefix; the next call without it does not."""
    from mirror_mlx import load
    from mirror_mlx.prompt_cache import read

    pipe, fresh = load(str(templated)), load(str(templated))
    try:
        from mlx_lm import stream_generate as mlx_lm_stream_generate
        from mlx_lm.models.cache import load_prompt_cache

        after = pipe.generate(" went to the park", prompt_cache=read(cache_files["mlx-lm"]), mode="ar", max_tokens=12)
        model, tokenizer = mlx_load(str(templated))
        expected = [r.token for r in mlx_lm_stream_generate(
            model, tokenizer, tokenizer.encode(" went to the park", add_special_tokens=False), max_tokens=12,
            prompt_cache=load_prompt_cache(cache_files["mlx-lm"]))]
        assert_lossless(after.tokens, expected[: len(after.tokens)])
        assert len(after.tokens) >= 11
        ids = pipe.tokenizer.encode("Tom and Lily", add_special_tokens=False)  # (after a BOS the tiny model
        # hardly looks back, so a left-over prefix would not show)
        again = pipe.generate(ids, mode="ar", max_tokens=12)
        assert again.tokens == fresh.generate(ids, mode="ar", max_tokens=12).tokens
    finally:
        pipe.close()
        fresh.close()
