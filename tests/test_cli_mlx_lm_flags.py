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
from mlx_lm.generate import main as mlx_lm_generate_main
from mlx_lm.sample_utils import apply_min_p

from mirror_mlx.cli import main
from tests.models import DRAFT_PATH, TARGET_PATH
from tests.test_mlx_lm_compat import lora_adapter

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


def mlx_lm_prints(*args) -> str:
    out = io.StringIO()
    argv = sys.argv
    sys.argv = ["mlx_lm.generate", *args, "--verbose", "False"]
    try:
        with contextlib.redirect_stdout(out):
            mlx_lm_generate_main()
    finally:
        sys.argv = argv
    return out.getvalue()


def ours(*args, mode="mirror"):
    return CliRunner().invoke(main, ["generate", *args, "--quiet", "--mode", mode, "--draft-model", str(DRAFT_PATH),
                                     "--kappa", "4", "--gamma", "4"])


ROWS = {  # flag: (the model, extra flags); the prompt and --max-tokens 24 are added to both
    "--system-prompt": ("templated", ["--system-prompt", "You tell short stories."]),
    "--ignore-chat-template": ("templated", ["--ignore-chat-template"]),
    "--chat-template-config": ("templated", ["--chat-template-config", '{"greeting": "Hello there."}']),
    "--use-default-chat-template": ("templated", ["--use-default-chat-template"]),
    "--extra-eos-token": ("plain", ["--extra-eos-token", "."]),
    "--max-kv-size": ("plain", ["--max-kv-size", "256"]),
    "--trust-remote-code": ("plain", ["--trust-remote-code"]),
    "--top-k 1 at --temp 2": ("plain", ["--temp", "2.0", "--top-k", "1"]),
}


@pytest.mark.parametrize("flag", ROWS)
def test_flag_prints_what_mlx_lm_prints(flag, templated):
    which, extra = ROWS[flag]
    model = str(templated if which == "templated" else TARGET_PATH)
    args = ["--model", model, "--prompt", "Tom and Lily", "--max-tokens", "24", *extra]
    expected = mlx_lm_prints(*args)
    result = ours(*args)
    assert result.exit_code == 0, result.output
    assert result.stdout == expected


def test_the_template_flags_change_the_prompt(templated):
    """The rows above would pass vacuously if a flag changed nothing: each one changes mlx-lm's output."""
    base = ["--model", str(templated), "--prompt", "Tom and Lily", "--max-tokens", "24"]
    plain = mlx_lm_prints(*base)
    for flag in ("--system-prompt", "--ignore-chat-template", "--chat-template-config"):
        assert mlx_lm_prints(*base, *ROWS[flag][1]) != plain, flag
    assert mlx_lm_prints("--model", str(TARGET_PATH), "--prompt", "Tom and Lily", "--max-tokens", "24",
                         "--extra-eos-token", ".").count(" ") < 12  # it stopped at the first full stop


def test_system_prompt_appears_in_the_templated_prompt(templated):
    from mirror_mlx.cli import prompt_ids

    _, tokenizer = mlx_load(str(templated))
    text = tokenizer.decode(prompt_ids(tokenizer, "Tom and Lily", "You tell short stories.", False, {"greeting": "Hi."}))
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
    (["--prompt-cache-file", "x.safetensors"], "--prompt-cache-file is not supported yet"),
    (["--chat-template-config", "{enable"], "--chat-template-config is not valid JSON"),
    (["--extra-eos-token", "no-such-token"], "--extra-eos-token 'no-such-token' is not a token"),
    (["--adapter-path", "/no/such/adapter"], "--adapter-path '/no/such/adapter' is not a folder"),
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
