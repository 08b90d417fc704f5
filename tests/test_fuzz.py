"""Random options and prompts, valid and invalid, through `Pipeline.generate` and the CLI.

Every case ends in a ValueError/TypeError (exit 2 with one line for the CLI) or in output that equals
`mode="ar"` greedy at temperature 0 (in-range tokens, at most max_tokens, otherwise); never a crash,
a hang, a traceback or a shared-memory segment left behind. The same goes for streaming (`Pipeline.stream`,
stopped anywhere), chat (`Pipeline.chat`), stop strings, and HTTP bodies sent to a live `mirror-mlx serve`
(a 400 naming the problem, or the pipeline's own text). `make test` runs a few dozen fixed examples;
`make fuzz` (MIRROR_MLX_FUZZ=fuzz) searches with many more, random ones.
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
from tests import leaks
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mirror_mlx.cli import main
from tests.support import assert_lossless

ROOT = Path(__file__).resolve().parents[1]
VOCAB, DRAFT_CONTEXT = 512, 256  # the demo pair

common = dict(deadline=None, suppress_health_check=list(HealthCheck))
# `make test`: the same examples every run (a failure reproduces; a pass is not luck); `make fuzz` searches
settings.register_profile("quick", max_examples=25, derandomize=True, database=None, **common)
settings.register_profile("fuzz", max_examples=int(os.environ.get("MIRROR_MLX_FUZZ_EXAMPLES", "500")), **common)
PROFILE = os.environ.get("MIRROR_MLX_FUZZ", "quick")
FUZZ = settings(settings.get_profile(PROFILE))
CLI_FUZZ = settings(FUZZ, max_examples=max(10, FUZZ.max_examples // 3))
SUBPROCESS_FUZZ = settings(FUZZ, max_examples=1 if PROFILE == "quick" else 20)  # a process start costs seconds
FEW = settings(FUZZ, max_examples=max(10, FUZZ.max_examples // 4))  # a few generations per example

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
                assert_lossless(out.tokens, pipe.generate(prompt, mode="ar", max_tokens=max_tokens, stop=False).tokens)
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
        assert_lossless(tokens, ref.tokens[: len(tokens)])


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


# --- streaming, chat, stop strings ---------------------------------------------------------------


@FEW
@given(case=cases, cut=st.integers(0, 8))
def test_stream_refuses_at_the_call_or_yields_what_generate_returns_and_stops_anywhere(pipe, shm_made, case, cut):
    """Bad input raises at the call; a stream read to the end is `generate`'s result (greedy: ar's);
    one closed after `cut` chunks leaves the pipeline free and lossless for the next call."""
    prompt, kwargs = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            chunks = pipe.stream(prompt, stop=False, **kwargs)
        except (ValueError, TypeError) as e:
            assert str(e) and "\n" not in str(e)
            return
        got = []
        for i, chunk in enumerate(chunks):
            if i == cut:
                break
            got.append(chunk)
        chunks.close()
        event("stopped early" if len(got) == cut else "read to the end")
        tokens = [t for c in got for t in c.tokens]
        assert len(tokens) <= kwargs["max_tokens"] and all(0 <= t < VOCAB for t in tokens)
        if greedy(kwargs.get("temperature", 0.0)):
            ref = pipe.generate(prompt, mode="ar", max_tokens=kwargs["max_tokens"], stop=False)
            assert_lossless(tokens, ref.tokens[: len(tokens)])  # the stopped stream's prefix, and the next call works
            if len(got) < cut:  # read to the end
                assert_lossless(tokens, ref.tokens)
                assert "".join(c.text for c in got) == ref.text
    assert leftover(shm_made) == []


roles = st.sampled_from(["user", "assistant", "system", "tool", "", "USER"])
messages = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": texts}), min_size=1, max_size=2),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]), "content": texts}),
             min_size=1, max_size=3),
    st.lists(st.one_of(st.fixed_dictionaries({"role": roles, "content": st.one_of(texts, junk)}),
                       st.dictionaries(st.text(max_size=5), junk, max_size=2), junk, texts), max_size=3),
)


@FEW
@given(msgs=messages, kwargs=st.one_of(valid_knobs, knobs))
def test_chat_refuses_clearly_or_replies_with_ar_greedy(pipe, shm_made, msgs, kwargs):
    """`Pipeline.chat` on any messages: a one-line ValueError/TypeError, or a reply; greedy, the reply is
    ar's greedy continuation of the ids the chat ran."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no chat template in the demo pair
        try:
            out = pipe.chat(msgs, stop=False, **kwargs)
        except (ValueError, TypeError) as e:
            event(f"refused: {type(e).__name__}")
            assert str(e) and "\n" not in str(e)
            return
        event(f"replied ({out.stats.mode})")
        assert len(out.tokens) == kwargs["max_tokens"] and all(0 <= t < VOCAB for t in out.tokens)
        ids, reply = pipe.conversation.tokens[: -len(out.tokens)], pipe.conversation.tokens[-len(out.tokens):]
        assert reply == out.tokens  # the conversation ran `ids` and remembers the reply
        if greedy(kwargs.get("temperature", 0.0)):
            assert_lossless(out.tokens,
                            pipe.generate(ids, mode="ar", max_tokens=kwargs["max_tokens"], stop=False).tokens)
    assert leftover(shm_made) == []


@FUZZ
@given(text=st.text("abc ", max_size=30), stops=st.lists(st.text("abc", min_size=1, max_size=3), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_stop_strings_cut_at_the_first_whatever_the_pieces(text, stops, cuts):
    """The server's StopText, fed the text in any pieces: what it sends is the text up to the first stop
    string (all of it when there is none), and it never sends a character it must later take back."""
    from mirror_mlx.server import StopText

    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    s, sent, hit = StopText(stops), "", False
    for lo, hi in zip(bounds, bounds[1:]):
        piece, hit = s.feed(text[lo:hi])
        sent += piece
        if hit:
            break
    if not hit:
        sent += s.flush()
    first = min((i for i in (text.find(x) for x in stops) if i >= 0), default=None)
    assert sent == (text if first is None else text[:first])
    assert hit == (first is not None)


# --- HTTP bodies, against a live server -----------------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One `mirror-mlx serve` for the module; it must stop on Ctrl-C and leave no segment behind."""
    from tests.support.servers import running, stop_server
    import signal

    log = tmp_path_factory.mktemp("fuzz-serve") / "server.log"
    with running(log, "--mode", "mirror") as (proc, url):
        yield url
        assert stop_server(proc, signal.SIGINT) == 0, log.read_text()[-3000:]
        text = log.read_text()
        assert "Traceback" not in text and "leaked" not in text, text[-3000:]
        assert leaks.wait_unlinked(leaks.made_in(text)) == []


def send(url: str, path: str, raw: bytes) -> tuple[int, str, str]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + path, raw, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


stop_field = st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3), junk)
http_common = {"temperature": st.one_of(st.just(0), junk),
               "stop": stop_field, "stream": st.one_of(st.booleans(), junk), "mode": st.sampled_from(["mirror", "sd", "ar", "x"]),
               "kappa": st.one_of(st.integers(1, 4), junk), "gamma": st.one_of(st.integers(1, 4), junk),
               "model": st.sampled_from(["stories260K", "nope"])}
http_tokens = st.one_of(st.integers(1, 6), st.integers(1, 6), junk)  # always given: the default, 256, is slow
completion_bodies = st.fixed_dictionaries({"prompt": st.one_of(texts, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)),
                                           "max_tokens": http_tokens},
                                          optional=dict(http_common, prompt2=junk))
chat_bodies = st.fixed_dictionaries({"messages": messages, "max_tokens": http_tokens}, optional=http_common)
valid_stop = st.one_of(st.text("abcdefghijklmnopqrstuvwxyz ", min_size=1, max_size=3),
                       st.lists(st.text("abcdefghijklmnopqrstuvwxyz ", min_size=1, max_size=3), max_size=3))
valid_http = {"temperature": st.just(0), "stop": valid_stop, "stream": st.booleans(),
              "mode": st.sampled_from(["mirror", "sd", "ar"]), "kappa": st.integers(1, 4), "gamma": st.integers(1, 4)}
valid_completion = st.fixed_dictionaries({"prompt": valid_prompts, "max_tokens": st.integers(1, 6)}, optional=valid_http)
valid_chat = st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": texts}),
                                                         min_size=1, max_size=2),
                                    "max_tokens": st.integers(1, 6)}, optional=valid_http)
bodies = st.one_of(st.tuples(st.just("/completions"), valid_completion), st.tuples(st.just("/chat/completions"), valid_chat),
                   st.tuples(st.just("/completions"), completion_bodies), st.tuples(st.just("/chat/completions"), chat_bodies),
                   st.tuples(st.sampled_from(["/completions", "/chat/completions"]),
                             st.one_of(st.dictionaries(st.text(max_size=6), junk, max_size=3), junk)))


def expected_text(ref: str, stop) -> str:
    stops = [stop] if isinstance(stop, str) else stop or []
    first = min((i for i in (ref.find(x) for x in stops) if i >= 0), default=None)
    return ref if first is None else ref[:first]


@FEW
@given(case=bodies, raw=st.one_of(st.none(), st.none(), st.binary(max_size=20)))
def test_any_http_body_is_a_400_naming_the_problem_or_the_pipelines_text(live, pipe, case, raw):
    """A JSON body of any shape (or any bytes) gets a 400 with one-line error JSON, or a 200 whose text
    is `Pipeline.generate`'s greedy text cut at the first stop string, streamed or not; never a 500."""
    path, body = case
    data = raw if raw is not None else json.dumps(body, allow_nan=True).encode()
    status, kind, text = send(live, path, data)
    event(f"{path} {status}")
    assert status in (200, 400, 404, 413), (status, text[:500])
    if status != 200:
        error = json.loads(text)["error"]
        assert error["message"] and "\n" not in error["message"] and "Traceback" not in text
        return
    if "text/event-stream" in kind:
        events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", text[-500:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not [c for c in chunks if "error" in c], text[-500:]
        pieces = [ch.get("text") or ch.get("delta", {}).get("content") or "" for c in chunks for ch in c.get("choices", [])]
        got = "".join(pieces)
    else:
        choice = json.loads(text)["choices"][0]
        got = choice["text"] if path == "/completions" else choice["message"]["content"]
    if path == "/completions" and body.get("temperature", 0) == 0 and body.get("mode") in ("mirror", "sd", "ar", None):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = pipe.generate(body["prompt"], max_tokens=body["max_tokens"], mode="ar").text
        assert got == expected_text(ref, body.get("stop")), (body, got, ref)
