"""`mirror-mlx serve`: a real server in a subprocess on a free loopback port, talked to with the
real `openai` client (and raw HTTP where a client would refuse to send the request)."""

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import urllib.error
import urllib.request
import openai
import pytest

import mirror_mlx
from mirror_mlx.server import StopText
from tests import leaks
from tests.models import templated_target
from tests.support.processes import children, orphans
from tests.support.servers import health, in_process, running

PROMPT = "Once upon a time"
USER = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def server(serve):
    # one request at a time here (the queue and its 429); the batch regime: tests/test_server_batch.py.
    # Stopped with Ctrl-C at the end (conftest.serve checks it ends cleanly); SIGTERM mid-stream is below
    return serve("--max-queue", "1", "--decode-concurrency", "1")


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def ref(pipe):
    """`Pipeline.generate`'s greedy text, computed once per (prompt, max_tokens)."""
    done: dict = {}

    def text(prompt, max_tokens: int) -> str:
        key = (str(prompt), max_tokens)
        if key not in done:
            done[key] = pipe.generate(prompt, max_tokens=max_tokens).text
        return done[key]

    return text


def post(url: str, raw: bytes) -> tuple[int, dict]:
    """Raw HTTP, for requests a client library would refuse to send."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, raw, method="POST"), timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# --- answers ----------------------------------------------------------------------------------


def test_models_and_health(server, client, model):
    assert model == "stories260K"
    assert health(server[0])["status"] == "ok"
    preflight = urllib.request.Request(server[0] + "/chat/completions", method="OPTIONS",
                                       headers={"Origin": "http://localhost:5173"})
    with urllib.request.urlopen(preflight, timeout=30) as r:  # a browser front-end on another local port
        assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "http://localhost:5173"
        assert "POST" in r.headers["Access-Control-Allow-Methods"]


def test_chat_greedy_equals_pipeline_generate(client, model, pipe, ref):
    expected = ref(PROMPT, 40)
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=40, temperature=0,
                                       extra_body={"mode": "mirror"})  # the default, auto, may pick ar here
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(pipe.encode(PROMPT)), 40)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 40
    x = r.model_extra["x_mirror"]
    assert x["mode"] == "mirror" and x["generation_tokens"] == 40 and x["mean_accepted"] > 1
    assert {"reuse_rate", "hidden_draft_fraction", "fallback_rate"} <= set(x)


def test_chat_stream_with_usage(client, model, ref):
    chunks = list(client.chat.completions.create(model=model, messages=USER, max_tokens=40, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref(PROMPT, 40)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40


def test_x_timeline_streams_each_step_s_record_and_nothing_else_changes(client, model, ref):
    """The chat page's step records (`x_timeline`) ride on the chunks; a reply that does not ask has none."""
    asked = list(client.chat.completions.create(model=model, messages=USER, max_tokens=40, stream=True,
                                                extra_body={"mode": "mirror", "x_timeline": True}))
    steps = [s for c in asked for s in c.model_extra.get("x_mirror_steps", [])]
    assert "".join(c.choices[0].delta.content or "" for c in asked) == ref(PROMPT, 40)
    assert "".join(t[0] for s in steps for t in s["tokens"]) == ref(PROMPT, 40)
    assert [s["n"] for s in steps] == list(range(1, len(steps) + 1)) == list(range(1, asked[-1].model_extra[
        "x_mirror"]["steps"] + 1)) and steps[0]["knobs"].startswith("mirror κ=")
    assert all(s["t"][0] <= s["suffix"][0] < s["suffix"][1] <= s["t"][1] for s in steps)
    plain = list(client.chat.completions.create(model=model, messages=USER, max_tokens=40, stream=True,
                                                extra_body={"mode": "mirror"}))
    assert not any("x_mirror_steps" in c.model_extra for c in plain)
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, extra_body={"x_timeline": True})
    assert len(whole.model_extra["x_mirror_steps"]) == whole.model_extra["x_mirror"]["steps"]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_equals_pipeline_generate(client, model, ref, stream):
    r = client.completions.create(model=model, prompt="The dog", max_tokens=24, stream=stream)
    text = "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text
    assert text == ref("The dog", 24)
    if not stream:
        assert r.object == "text_completion" and r.usage.completion_tokens == 24


@pytest.mark.parametrize("mode,knobs", [("sd", {}), ("ar", {}), ("mirror", {"kappa": 2, "branches": 3})])
def test_every_mode_returns_the_same_text(client, model, ref, mode, knobs):
    """(mirror with a branch budget of its request's own)"""
    r = client.completions.create(model=model, prompt="The dog", max_tokens=24,
                                  extra_body={"mode": mode, "gamma": 4, **knobs})
    assert r.choices[0].text == ref("The dog", 24) and r.model_extra["x_mirror"]["mode"] == mode
    if "branches" in knobs:
        assert r.model_extra["x_mirror"]["branches"] == 3 and r.model_extra["x_mirror"]["branches_per_step"] <= 3


def test_a_request_may_ask_for_the_lookup(client, model, ref):
    prompt = "The dog ran. The dog ran. The dog"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=24,
                                  extra_body={"mode": "sd", "gamma": 4, "lookup": True, "ngram_min": 2})
    x = r.model_extra["x_mirror"]
    assert r.choices[0].text == ref(prompt, 24) and x["mode"] == "sd" and x["lookup"] and x["lookup_windows"] > 0


def test_sampling_fields_reach_the_engine(client, model, pipe, ref):
    """Deterministic checks (seeded sampling is not reproducible across calls yet, see the report):
    top_k=1 makes T=0.9 greedy; a repetition penalty changes the greedy text as it does in-process."""
    r = client.completions.create(model=model, prompt="The dog", max_tokens=24, temperature=0.9, top_p=0.95,
                                  extra_body={"top_k": 1, "min_p": 0.01})
    assert r.choices[0].text == ref("The dog", 24)
    r = client.completions.create(model=model, prompt="The dog", max_tokens=24,
                                  extra_body={"repetition_penalty": 1.5})
    expected = pipe.generate("The dog", max_tokens=24, repetition_penalty=1.5).text
    assert r.choices[0].text == expected != ref("The dog", 24)


def test_token_id_prompt(client, model, pipe, ref):
    r = client.completions.create(model=model, prompt=pipe.encode("The dog"), max_tokens=24)
    assert r.choices[0].text == ref("The dog", 24)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_across_token_boundary(client, model, ref, stream):
    expected = ref(PROMPT, 40)
    stop = "tle gi"  # "lit|tle" + " g|irl": the stop string spans two tokens
    assert stop in expected
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=40, stop=[stop, "zzz"], stream=stream)
    if stream:
        chunks = [c for c in r if c.choices]
        pieces = [c.choices[0].delta.content or "" for c in chunks]
        assert all("tle" not in p for p in pieces)  # the held-back start of the stop string never leaks
        text, finish = "".join(pieces), chunks[-1].choices[0].finish_reason
    else:
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert (text, finish) == (expected[: expected.index(stop)], "stop")


def test_stop_text_holds_back_a_possible_start():
    s = StopText(["END", "xy"])
    assert s.feed("abcE") == ("abc", False)
    assert s.feed("N") == ("", False)
    assert s.feed("Dzzz") == ("", True)
    s = StopText(["END"])
    assert s.feed("abE") == ("ab", False) and s.feed("x") == ("Ex", False) and s.flush() == ""


@pytest.mark.filterwarnings("ignore:the model has no chat template")
def test_second_turn_reports_cached_prompt_tokens(client, model, pipe):
    first = client.chat.completions.create(model=model, messages=USER, max_tokens=20)
    reply = first.choices[0].message.content
    turn2 = USER + [{"role": "assistant", "content": reply}, {"role": "user", "content": " Then"}]
    second = client.chat.completions.create(model=model, messages=turn2, max_tokens=20)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens + 20 - 1  # the first turn and its reply came from the cache
    assert second.model_extra["x_mirror"]["prefill_tokens"] == second.usage.prompt_tokens - 1 - cached
    pipe.reset()
    ref1 = pipe.chat(USER, max_tokens=20)
    assert ref1.text == reply
    ref2 = pipe.chat(USER + [{"role": "assistant", "content": ref1.text}, {"role": "user", "content": " Then"}],
                     max_tokens=20)
    assert second.choices[0].message.content == ref2.text


# --- bad requests -----------------------------------------------------------------------------

LONG = [t % 500 + 3 for t in range(600)]  # 600 token ids: beyond the demo's 512-token context

BAD = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", [1, 2], 400, None),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0]"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "kappa": 0}, 400, "kappa"),
    ("/v1/completions", {"prompt": "x", "gamma": 2.5}, 400, "gamma"),
    ("/v1/completions", {"prompt": "x", "branches": 0}, 400, "branches"),
    ("/v1/completions", {"prompt": "x", "kappa": 2, "gamma": 3, "branches": 9}, 400, "branches"),
    ("/v1/completions", {"prompt": "x", "mode": "fast"}, 400, "mode"),
    ("/v1/completions", {"prompt": "x", "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "lookup": "yes"}, 400, "lookup"),
    ("/v1/completions", {"prompt": "x", "lookup": True, "mode": "ar"}, 400, "mode"),
    ("/v1/completions", {"prompt": "x", "lookup": True, "mode": "sd", "ngram_max": 0}, 400, "ngram_max"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "exit_layer": 99}, 400, "exit_layer"),
    ("/v1/completions", {"prompt": "x", "stop": 7}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": USER, "x_timeline": 1}, 400, "x_timeline"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/embeddings", {"input": "x"}, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{b[0]}:{b[3]}:{i}" for i, b in enumerate(BAD)])
def test_bad_request_gets_status_and_error_body(server, path, body, status, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    code, body = post(server[0].removesuffix("/v1") + path, raw)
    assert code == status
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert "\n" not in error["message"] and "Traceback" not in error["message"]


ONE_BAD = {"temperature": -1, "top_p": 0, "min_p": 2, "top_k": -1, "repetition_penalty": 0, "seed": "x",
           "kappa": 0, "gamma": 0, "exit_layer": 99, "branches": 0, "mode": "fast", "lookup": "yes", "ngram_max": 0,
           "ngram_min": 99, "max_tokens": 0, "max_completion_tokens": 1.5}  # one bad value per decode option


@pytest.mark.parametrize("name,value", ONE_BAD.items(), ids=list(ONE_BAD))
def test_each_bad_option_is_named_by_the_check_s_own_field(server, name, value):
    """Every decode option is checked once (validate), and the 400 names the field from the error's `param`."""
    body = {"prompt": "x", "mode": "mirror", "kappa": 2, "gamma": 3, "lookup": True, name: value}
    code, answer = post(server[0].removesuffix("/v1") + "/v1/completions", json.dumps(body).encode())
    assert code == 400 and answer["error"]["param"] == name, answer
    assert "\n" not in answer["error"]["message"]


@pytest.mark.parametrize("body,names", [
    ({"prompt": LONG}, ["600 tokens", "512"]),
    ({"prompt": "Once upon a time", "max_tokens": 1000}, ["1000", "512"]),
])
def test_beyond_the_context_is_a_400_naming_the_limit(client, model, body, names):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, **body)
    assert e.value.status_code == 400 and all(n in e.value.body["message"] for n in names)


# --- concurrency and failures -----------------------------------------------------------------


def test_client_disconnect_stops_the_generation(server, client, model, ref):
    before = health(server[0])["disconnected"]
    stream = client.chat.completions.create(model=model, messages=USER, max_tokens=400, stream=True)
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen == 2:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while health(server[0])["disconnected"] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health(server[0])["disconnected"] == before + 1
    cut = [line for line in server[1].read_text().splitlines() if "client went away after" in line][-1]
    assert int(cut.split("after ")[1].split()[0]) < 100  # stopped within a few steps, not at 400
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=40)
    assert r.choices[0].message.content == ref(PROMPT, 40)


def test_queue_full_is_429_with_retry_after(server, client, model, ref):
    running = client.completions.create(model=model, prompt=PROMPT, max_tokens=400, stream=True)
    next(iter(running))  # decoding now
    waited: dict = {}

    def queued():
        waited["text"] = client.completions.create(model=model, prompt="The dog", max_tokens=24).choices[0].text

    t = threading.Thread(target=queued)
    t.start()
    deadline = time.monotonic() + 20
    while health(server[0])["waiting"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=model, prompt="The cat", max_tokens=8)
    assert e.value.status_code == 429 and int(e.value.response.headers["retry-after"]) >= 1
    assert e.value.body["code"] == "queue_full"
    running.close()  # the queued request runs next
    t.join(60)
    assert waited["text"] == ref("The dog", 24)


def test_chat_template_is_applied_and_turns_stay_cached(tmp_path):
    """A target with a chat template: the prompt is the rendered conversation, and the second turn
    prefills only what follows the first turn's prompt and reply."""
    folder = templated_target(tmp_path / "templated")
    p = mirror_mlx.load(folder, exit_adapter="none")
    try:
        messages = [{"role": "user", "content": "Tell me a story"}]
        ids = p.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        expected = p.generate(ids, max_tokens=12, mode="ar")
        with in_process(p, mode="ar") as (_, c):
            first = c.chat.completions.create(model="stories260K", messages=messages, max_tokens=12)
            assert first.choices[0].message.content == expected.text
            assert first.usage.prompt_tokens == len(ids)
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "More"}]
            second = c.chat.completions.create(model="stories260K", messages=messages, max_tokens=12)
            assert second.usage.prompt_tokens_details.cached_tokens >= len(ids) + 12 - 1
    finally:
        p.close()


def test_engine_failure_is_a_500_and_the_server_keeps_serving(pipe, ref, monkeypatch):
    """In process, so the engine can be made to fail: the HTTP path is the real one."""
    generate = pipe.engine.generate

    def broken(prompt, opts, *rest, **kwargs):
        steps = generate(prompt, opts, *rest, **kwargs)
        yield next(steps)
        steps.close()
        raise RuntimeError("the accelerator fell over\nsecond line")

    with in_process(pipe) as (server, c):
        monkeypatch.setattr(pipe.engine, "generate", broken)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="stories260K", prompt=PROMPT, max_tokens=30)
        assert e.value.status_code == 500 and e.value.body["message"] == (
            "generation failed: RuntimeError: the accelerator fell over second line")
        with pytest.raises(openai.APIError, match="accelerator fell over"):
            list(c.completions.create(model="stories260K", prompt=PROMPT, max_tokens=30, stream=True))
        monkeypatch.setattr(pipe.engine, "generate", generate)
        assert c.completions.create(model="stories260K", prompt=PROMPT, max_tokens=40).choices[0].text == ref(PROMPT, 40)
        assert server.counts["errors"] == 2


def test_a_request_is_checked_once(pipe, monkeypatch):
    """The one check (validate.request) runs once per request: a call in an explicit mode whose knobs come from
    the pair's profile (its own grid, trusted as auto's choice is), and a server's request, checked when it came
    in and not again when it runs."""
    from mirror_mlx import validate
    from mirror_mlx.tune import profile as profiles

    calls = []
    check = validate.request
    monkeypatch.setattr(validate, "request", lambda *a, **k: calls.append(1) or check(*a, **k))
    sd = dict(mode="sd", kappa=None, gamma=2, exit_layer=None, predicted=100.0)
    monkeypatch.setattr(pipe.auto, "profile", profiles.Profile(key={}, mode="sd", gamma=2, why="tuned", table=[sd]))
    stats = pipe.generate(PROMPT, max_tokens=8, mode="sd").stats
    assert (stats.mode, stats.gamma, len(calls)) == ("sd", 2, 1), (stats.why, calls)
    with in_process(pipe) as (_, c):
        calls.clear()
        assert c.completions.create(model="stories260K", prompt=PROMPT, max_tokens=8).choices[0].text
        assert len(calls) == 1


# --- shutdown ---------------------------------------------------------------------------------


def test_sigterm_mid_stream_shuts_down_cleanly(tmp_path):
    log = tmp_path / "server.log"
    with running(log) as (proc, url):
        sigterm_mid_stream(proc, url, log)


def sigterm_mid_stream(proc: subprocess.Popen, url: str, log: Path) -> None:
    c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
    stream = c.chat.completions.create(messages=USER, model="stories260K", max_tokens=400, stream=True)
    chunks = iter(stream)
    next(chunks), next(chunks)
    shm, kids = leaks.mapped(proc.pid) | set(leaks.made_in(log.read_text())), children(proc.pid)
    assert shm and kids, "a mirror-mode decode maps its token rings, made by the server, for its draft host"
    proc.send_signal(signal.SIGTERM)
    with pytest.raises(openai.APIError, match="shutting down"):
        for _ in chunks:  # the in-flight stream ends with an error event, not a hang
            pass
    assert proc.wait(timeout=30) == 0, log.read_text()
    assert not orphans(kids), "an orphan process outlived the server"
    assert "stopped" in log.read_text() and "leaked" not in log.read_text()  # the tracker reports leaks there
    assert leaks.wait_unlinked(shm) == [], "the server left a shared-memory segment behind"


def test_a_server_of_the_recycled_draft_serves_the_target_s_tokens(tmp_path, ref):
    """`mirror-mlx serve --draft-model recycle`: a real client's completion is the target's greedy text, and the
    reply's stats say trees ran and what they had accepted."""
    with running(tmp_path / "server.log", "--draft-model", "recycle") as (proc, url):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        for prompt in ("The dog ran. The dog ran. The dog", "Once upon a time"):
            r = client.completions.create(model=model, prompt=prompt, max_tokens=24)
            x = r.model_extra["x_mirror"]
            assert r.choices[0].text == ref(prompt, 24) and x["mode"] == "sd" and x["recycle"] == "tree"
        assert x["proposed"] > 0
