"""Random options and prompts, valid and invalid, through `Pipeline.generate` and the CLI.

Every case ends in a ValueError/TypeError (exit 2 with one line for the CLI) or in output that equals
`mode="ar"` greedy at temperature 0 (in-range tokens, at most max_tokens, otherwise); never a crash,
a hang, a traceback or a ring left in /dev/shm. `make test` runs a few dozen examples; `make fuzz`
(MIRROR_MLX_FUZZ=fuzz) runs many more.
"""

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from conftest import leftover
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mirror_mlx.cli import main
from mirror_mlx.pipeline import load

ROOT = Path(__file__).resolve().parents[1]
VOCAB, DRAFT_CONTEXT = 512, 256  # the demo pair

common = dict(deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("quick", max_examples=25, **common)
settings.register_profile("fuzz", max_examples=int(os.environ.get("MIRROR_MLX_FUZZ_EXAMPLES", "500")), **common)
PROFILE = os.environ.get("MIRROR_MLX_FUZZ", "quick")
FUZZ = settings(settings.get_profile(PROFILE))
CLI_FUZZ = settings(FUZZ, max_examples=max(10, FUZZ.max_examples // 3))
SUBPROCESS_FUZZ = settings(FUZZ, max_examples=1 if PROFILE == "quick" else 20)  # a process start costs seconds

# --- strategies: every knob is sometimes fine, sometimes nonsense -------------------------------------

# out-of-range ints are far out (a κ of 300 is valid but slow: the valid ranges below stay small)
junk = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(), st.text(max_size=3),
                 st.integers(max_value=-1), st.integers(min_value=2**20))
knobs = st.fixed_dictionaries({  # max_tokens always: the default 256 would make each example slow
    "max_tokens": st.one_of(st.integers(1, 6), st.integers(1, 6), st.integers(max_value=0), junk),
}, optional={
    "temperature": st.one_of(st.just(0.0), st.floats(0.01, 2.0), junk),
    "top_p": st.one_of(st.floats(0.05, 1.0), junk),
    "top_k": st.one_of(st.integers(0, VOCAB), junk),
    "min_p": st.one_of(st.floats(0.0, 0.5), junk),
    "kappa": st.one_of(st.integers(1, 8), st.integers(max_value=0), st.integers(min_value=VOCAB + 1), junk),
    "gamma": st.one_of(st.integers(1, 6), st.integers(max_value=0), st.integers(min_value=DRAFT_CONTEXT + 1), junk),
    "exit_layer": st.one_of(st.none(), st.integers(-3, 8), junk),
    "seed": st.one_of(st.none(), st.integers(), junk),
    "mode": st.sampled_from(["mirror", "sd", "ar", "fast", "", None]),
})
valid_knobs = st.fixed_dictionaries({"max_tokens": st.integers(1, 6)}, optional={
    "temperature": st.one_of(st.just(0.0), st.floats(0.01, 2.0)),
    "top_p": st.floats(0.05, 1.0),
    "top_k": st.integers(0, VOCAB),
    "min_p": st.floats(0.0, 0.5),
    "kappa": st.integers(1, 8),
    "gamma": st.integers(1, 6),
    "exit_layer": st.one_of(st.none(), st.integers(1, 4)),
    "seed": st.one_of(st.none(), st.integers()),
    "mode": st.sampled_from(["mirror", "sd", "ar"]),
})
texts = st.one_of(st.text(max_size=40),  # any code point, surrogates included
                  st.text(st.characters(codec="utf-8"), min_size=1, max_size=40),
                  st.binary(max_size=40).map(lambda b: b.decode("utf-8", "surrogateescape")))
prompts = st.one_of(
    texts,
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
    st.lists(st.one_of(st.integers(-3, VOCAB + 3), st.integers(), st.floats(), st.booleans()), max_size=8),
    st.binary(max_size=12),
)
valid_prompts = st.one_of(texts, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24))
cases = st.one_of(st.tuples(valid_prompts, valid_knobs), st.tuples(prompts, knobs))  # about half generate


@pytest.fixture(scope="module")
def pipe():
    p = load()
    yield p
    p.close()






def greedy(temperature) -> bool:
    return isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature == 0


@FUZZ
@given(case=cases)
def test_generate_refuses_clearly_or_equals_ar_greedy(pipe, shm_made, case):
    prompt, kwargs = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the U+FFFD note
        try:
            out = pipe.generate(prompt, stop=False, **kwargs)
        except (ValueError, TypeError) as e:
            event(f"refused: {type(e).__name__}")
            message = str(e)
            assert message and "\n" not in message and not message.startswith("Traceback")
            out = None
        if out is not None:
            event(f"generated ({out.stats.mode})")
            max_tokens = kwargs["max_tokens"]
            assert len(out.tokens) == max_tokens and all(0 <= t < VOCAB for t in out.tokens)
            if greedy(kwargs.get("temperature", 0.0)):
                assert out.tokens == pipe.generate(prompt, mode="ar", max_tokens=max_tokens, stop=False).tokens
    assert leftover(shm_made) == []


def as_flag(value) -> str:
    return "nan" if isinstance(value, float) and math.isnan(value) else str(value)


FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temp", "top_p": "--top-p", "top_k": "--top-k",
         "kappa": "--kappa", "gamma": "--gamma", "exit_layer": "--exit-layer", "seed": "--seed", "mode": "--mode"}


def cli_args(prompt: str, kwargs: dict) -> list[str]:
    args = ["generate", "--json", f"--prompt={prompt}", "--max-tokens", "4"]
    for name, value in kwargs.items():
        if name in FLAGS and value is not None:
            args += [FLAGS[name], as_flag(value)]
    return args


def check_cli(code: int, stdout: str, stderr: str, pipe, prompt: str, kwargs: dict) -> None:
    """Exit 2 with one error line (a demo note may precede it), or 0 with ar's greedy tokens at T=0."""
    assert "Traceback" not in stderr and code in (0, 2), (code, stderr)
    if code == 2:
        lines = stderr.strip().splitlines()
        assert lines and lines[-1].startswith("mirror-mlx generate: error: ")
        assert all(line.startswith("mirror-mlx") for line in lines), stderr
        return
    tokens = json.loads(stdout)["tokens"]
    if greedy(kwargs.get("temperature", 0.0)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = pipe.generate(prompt, mode="ar", max_tokens=len(tokens) or 1)
        assert tokens == ref.tokens[: len(tokens)]


cli_texts = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=30).filter(lambda s: s != "-")


@CLI_FUZZ
@given(prompt=cli_texts, kwargs=st.one_of(valid_knobs, knobs))
def test_cli_exits_0_or_2_with_one_line(pipe, prompt, kwargs):
    result = CliRunner().invoke(main, prog_name="mirror-mlx", args=cli_args(prompt, kwargs))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    check_cli(result.exit_code, result.stdout, result.stderr, pipe, prompt, kwargs)


@SUBPROCESS_FUZZ
@given(data=st.binary(max_size=30), kwargs=st.one_of(valid_knobs, knobs))
def test_a_real_process_reads_random_bytes_and_ends_cleanly(pipe, data, kwargs):
    proc = subprocess.run([sys.executable, "-m", "mirror_mlx", *cli_args("-", kwargs)], cwd=ROOT, input=data,
                          capture_output=True, timeout=180)
    stderr = proc.stderr.decode("utf-8", "replace")
    assert "leaked shared_memory" not in stderr  # multiprocessing's resource tracker reports unlinked rings
    check_cli(proc.returncode, proc.stdout.decode(), stderr, pipe, data.decode("utf-8", "replace"), kwargs)
