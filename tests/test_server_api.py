"""`mirror-mlx serve` as apps use mlx_lm.server: tool calls, log-probabilities, the prefix cache across
conversations, CORS by origin, and the fields and routes apps send. In process (a real Server on a
loopback port, the real `openai` client), so a logits processor can force what the model writes."""

import contextlib
import io
import json
import logging
import shutil
import threading
import urllib.error
import urllib.request

import mlx.core as mx
import openai
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

import mirror_mlx
import mirror_mlx.text
from mirror_mlx.mlx_lm_api import stream_generate
from mirror_mlx.server import Server, ToolText, origin_allowed
from tests.models import CALL, TARGET_PATH, TOOL_TEMPLATE, WEATHER

PROMPT = "Once upon a time"
class Force:
    """A logits processor that makes the target write `ids` then end (what a model that calls tools does)."""

    def __init__(self, ids: list[int], eos: int):
        self.ids, self.eos, self.start = ids, eos, None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.start is None:
            self.start = tokens.size
        i = tokens.size - self.start
        want = self.ids[i] if i < len(self.ids) else self.eos
        return mx.where(mx.arange(logits.shape[-1]) == want, logits, -mx.inf)


@contextlib.contextmanager
def serving(pipe, log=None, **kwargs):
    defaults = {"mode": "ar", "temperature": 0.0, "top_p": 1.0, "top_k": 0, **kwargs.pop("defaults", {})}
    server = Server(("127.0.0.1", 0), pipe, "stories260K", defaults, log=log or io.StringIO(), **kwargs)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        yield server, url, openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
    finally:
        server.stop()
        thread.join(10)
        server.server_close()


def call(url: str, method: str = "GET", body=None, headers=None) -> tuple[int, dict, dict]:
    raw = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, raw, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            data = r.read()
            return r.status, dict(r.headers), json.loads(data) if data else {}
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


# --- tool calls -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_pipe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools") / "stories260K"
    shutil.copytree(TARGET_PATH, folder)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), chat_template=TOOL_TEMPLATE)))
    p = mirror_mlx.load(folder, exit_adapter="none")
    assert p.tokenizer.has_tool_calling and p.tokenizer.tool_call_start == "<tool_call>"  # mlx-lm's detection
    yield p
    p.close()


def test_tool_call_round_trip_through_the_openai_client(tool_pipe):
    tok = tool_pipe.tokenizer
    force = Force(tok.encode(CALL, add_special_tokens=False), tok.eos_token_id)
    messages = [{"role": "developer", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}]
    log = io.StringIO()
    with serving(tool_pipe, log, defaults={"logits_processors": [force]}) as (_, _, client):
        r = client.chat.completions.create(model="stories260K", messages=messages, tools=WEATHER, max_tokens=80)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [tc] = choice.message.tool_calls
        assert tc.type == "function" and tc.function.name == "get_weather" and tc.id
        assert json.loads(tc.function.arguments) == {"city": "Paris"}
        # the tools reached the chat template (and "developer" is the system role, as OpenAI treats it)
        rendered = [dict(messages[0], role="system"), messages[1]]
        assert r.usage.prompt_tokens == len(tok.apply_chat_template(rendered, tools=WEATHER, add_generation_prompt=True))

        force.start = None
        events = list(client.chat.completions.create(model="stories260K", messages=messages, tools=WEATHER,
                                                     max_tokens=80, stream=True))
        calls = [c for e in events for c in (e.choices[0].delta.tool_calls or [])]
        assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == \
            [(0, "get_weather", {"city": "Paris"})]
        assert "".join(e.choices[0].delta.content or "" for e in events) == ""  # no markup leaks as text
        assert events[-1].choices[0].finish_reason == "tool_calls"

        # the app runs the tool and sends the call and its result back
        force.ids, force.start = tok.encode("It is sunny.", add_special_tokens=False), None
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id, "content": '{"sky": "sunny"}'}]
        r2 = client.chat.completions.create(model="stories260K", messages=messages, tools=WEATHER, max_tokens=80)
        assert r2.choices[0].message.content == "It is sunny." and r2.choices[0].finish_reason == "stop"
        assert not r2.choices[0].message.tool_calls


def test_tool_text_splits_calls_across_pieces_and_keeps_unparsable_ones_visible(tool_pipe):
    notes = []
    split = ToolText(tool_pipe.tokenizer, WEATHER, notes.append)
    pieces = ["Sure. <tool", "_call>{\"name\": \"a\", \"argu", "ments\": {}}</tool_", "call> then <tool_call>{bad"]
    out = [split.feed(p) for p in pieces] + [split.flush()]
    assert "".join(t for t, _ in out) == "Sure.  then <tool_call>{bad"
    assert [c["function"] for _, cs in out for c in cs] == [{"name": "a", "arguments": "{}"}]
    assert len(notes) == 1 and "did not parse" in notes[0]


def test_tools_on_a_model_without_tool_calling_or_forced_choice_are_refused(pipe, tool_pipe):
    with serving(pipe) as (_, _, client):
        with pytest.raises(openai.BadRequestError, match="tool-call"):
            client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "hi"}],
                                           tools=WEATHER, max_tokens=4)
    with serving(tool_pipe) as (_, _, client):
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "hi"}],
                                           tools=WEATHER, tool_choice="required", max_tokens=4)


# --- log-probabilities ------------------------------------------------------------------------------


def mlx_lm_logprobs(model, ids: list[int], n: int, processors=None) -> list[tuple[int, mx.array]]:
    out = []
    for (token, logprobs), _ in zip(generate_step(mx.array(ids), model, logits_processors=processors), range(n)):
        out.append((int(token), logprobs))
    return out


@pytest.mark.parametrize("mode", ["ar", "sd", "mirror"])
def test_logprobs_equal_mlx_lm_generate_step(pipe, mode):
    ids = pipe.encode(PROMPT)
    ref = mlx_lm_logprobs(pipe.model, ids, 24, make_logits_processors(repetition_penalty=1.3))
    chunks = list(pipe.stream(ids, max_tokens=24, mode=mode, repetition_penalty=1.3, kappa=4, gamma=3))
    assert [t for c in chunks for t in c.tokens] == [t for t, _ in ref]
    for row, (t, lp) in zip([r for c in chunks for r in c.logprobs], ref):
        assert row.shape == lp.shape and mx.abs(row - lp).max().item() < 1e-4


def test_mlx_lm_api_records_carry_logprobs(pipe):
    ids = pipe.encode(PROMPT)
    ref = mlx_lm_logprobs(pipe.model, ids, 10)
    records = list(stream_generate(pipe.model, pipe.tokenizer, ids, max_tokens=10))
    assert [r.token for r in records] == [t for t, _ in ref]
    assert all(mx.abs(r.logprobs - lp).max().item() < 1e-4 for r, (_, lp) in zip(records, ref))


def test_server_logprobs_in_openai_shapes(pipe):
    ids = pipe.encode(PROMPT)
    ref = mlx_lm_logprobs(pipe.model, ids, 12)
    with serving(pipe, defaults={"mode": "mirror", "kappa": 4, "gamma": 3}) as (_, _, client):
        r = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=12, logprobs=True, top_logprobs=3)
        content = r.choices[0].logprobs.content
        assert [c.model_extra["id"] for c in content] == [t for t, _ in ref]
        for c, (t, lp) in zip(content, ref):
            assert abs(c.logprob - lp[t].item()) < 1e-4
            assert c.token == pipe.tokenizer.convert_ids_to_tokens(t)
            top = [x.logprob for x in c.top_logprobs]
            assert len(top) == 3 and top == sorted(top, reverse=True)
            assert abs(top[0] - mx.max(lp).item()) < 1e-4
        events = list(client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": PROMPT}],
                                                      max_tokens=12, logprobs=True, stream=True))
        streamed = [c.logprob for e in events if e.choices and e.choices[0].logprobs
                    for c in e.choices[0].logprobs.content]
        assert streamed == pytest.approx([c.logprob for c in content], abs=1e-6)

        done = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=12, logprobs=2)
        lp = done.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
        assert lp.token_logprobs == pytest.approx([x[t].item() for t, x in ref], abs=1e-4)
        assert all(len(t) == 2 for t in lp.top_logprobs)
        plain = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=4)
        assert plain.choices[0].logprobs is None


# --- CORS, routes, fields ---------------------------------------------------------------------------


def test_origins():
    assert all(origin_allowed(o, None) for o in ("http://localhost", "http://localhost:5173", "https://127.0.0.1:8443",
                                                 "http://[::1]:3000"))
    assert not any(origin_allowed(o, None) for o in ("https://evil.example", "http://localhost.evil.example",
                                                     "null", "http://127.0.0.1.nip.io", "file://"))
    assert origin_allowed("https://app.example", ("https://app.example",))
    assert not origin_allowed("http://localhost:3000", ("https://app.example",))
    assert origin_allowed("https://any.example", ("*",))


def test_foreign_pages_get_no_cors_grant_and_their_requests_are_refused(pipe):
    with serving(pipe) as (server, url, _):
        body = {"prompt": PROMPT, "max_tokens": 2}
        status, headers, _ = call(url + "/completions", "OPTIONS", headers={"Origin": "http://localhost:3000"})
        assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        status, headers, answer = call(url + "/completions", "POST", body, {"Origin": "http://localhost:3000"})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        before = server.counts["requests"]
        for method in ("OPTIONS", "POST", "GET"):
            status, headers, answer = call(url + "/completions" if method != "GET" else url + "/models", method,
                                           body if method == "POST" else None, {"Origin": "https://evil.example"})
            assert status == 403 and "Access-Control-Allow-Origin" not in headers
            assert answer["error"]["code"] == "origin_not_allowed" and "--allowed-origins" in answer["error"]["message"]
        assert server.counts["requests"] == before  # nothing ran
        status, headers, _ = call(url + "/models")  # no Origin: not a browser page
        assert status == 200 and "Access-Control-Allow-Origin" not in headers
    with serving(pipe, allowed_origins=("https://app.example",)) as (_, url, _):
        status, headers, _ = call(url + "/models", headers={"Origin": "https://app.example"})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert call(url + "/models", headers={"Origin": "http://localhost:3000"})[0] == 403


def test_model_routes_default_model_negative_seeds_and_unsupported_fields(pipe):
    with serving(pipe) as (_, url, client):
        assert client.models.retrieve("stories260K").id == "stories260K"
        assert call(url + "/models/default_model")[0] == 200
        status, _, answer = call(url + "/models/gpt-4")
        assert status == 404 and answer["error"]["code"] == "model_not_found"
        a = client.completions.create(model="default_model", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=-3)
        b = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=-3)
        assert a.choices[0].text == b.choices[0].text
        for field, value in (("logit_bias", {"5": 3}), ("presence_penalty", 0.5), ("response_format",
                                                                                   {"type": "json_object"})):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2, **{field: value})
            assert e.value.body["param"] == field and "not supported" in e.value.body["message"]
        # neutral values of fields it does not implement are what they would do anyway: accepted
        client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, presence_penalty=0, frequency_penalty=0)


# --- the prefix cache across conversations ----------------------------------------------------------

DOC = ("The little robot lived in a garden full of tall sunflowers. Every morning it watered the flowers, "
       "counted the bees and sang a song about the sun. One day a small bird landed on its head.")


def conversations(client, n_tokens: int = 10) -> list:
    """A, then two other conversations, then A's document again with a new question."""
    asks = [(DOC, "What did the robot do?"), ("A cat sat on a mat and looked at the moon.", "Why?"),
            ("The sea was calm and the boat was slow.", "Where?"), (DOC, "Who landed on its head?")]
    return [client.chat.completions.create(model="stories260K", max_tokens=n_tokens, messages=[
        {"role": "system", "content": doc}, {"role": "user", "content": q}]) for doc, q in asks]


def test_a_prefix_seen_two_conversations_earlier_is_not_prefilled_again(pipe):
    doc_ids = len(pipe.tokenizer.encode(DOC))
    log = io.StringIO()
    with serving(pipe, log, defaults={"mode": "mirror", "kappa": 4, "gamma": 3}) as (_, _, client):
        answers = conversations(client)
    last = answers[-1]
    assert last.usage.prompt_tokens_details.cached_tokens >= doc_ids
    assert last.model_extra["x_mirror"]["prefix_cache_tokens"] >= doc_ids
    assert "prefix cache: the target started from a stored cache" in log.getvalue()  # visible
    # lossless: the same text as a fresh run of the target alone
    ids = mirror_mlx.text.conversation(pipe.tokenizer, mirror_mlx.text.Conversation(), [
        {"role": "system", "content": DOC}, {"role": "user", "content": "Who landed on its head?"}])
    assert last.usage.prompt_tokens == len(ids)
    fresh = mirror_mlx.load(TARGET_PATH, exit_adapter="none")
    try:
        assert last.choices[0].message.content == fresh.generate(ids, max_tokens=10, mode="ar").text
    finally:
        fresh.close()
    with serving(pipe, prompt_cache_size=0) as (_, _, client):  # one slot: the document is prefilled again
        assert conversations(client)[-1].usage.prompt_tokens_details.cached_tokens < doc_ids // 4


# --- the command line -------------------------------------------------------------------------------


def test_serve_has_mlx_lm_servers_flags_and_refuses_bad_ones_before_loading():
    from click.testing import CliRunner

    from mirror_mlx.cli import main
    from mirror_mlx.cli.serve import size

    help_text = CliRunner().invoke(main, ["serve", "--help"]).output
    for flag in ("--adapter-path", "--trust-remote-code", "--chat-template-args", "--log-level", "--allowed-origins",
                 "--prompt-cache-size"):
        assert flag in help_text
    assert "512" in help_text.split("--max-tokens")[1].split("\n")[0]  # mlx_lm.server's default
    for args, words in ((["--chat-template-args", "{nope"], "--chat-template-args is not valid JSON"),
                        (["--chat-template-args", "[1]"], "must be a JSON object"),
                        (["--allowed-origins", " , "], "--allowed-origins is empty"),
                        (["--log-level", "LOUD"], "--log-level"),
                        (["--prompt-cache-bytes", "lots"], "is not a size")):
        r = CliRunner().invoke(main, ["serve", *args])
        assert r.exit_code == 2 and words in r.output, r.output
    assert [size(t) for t in ("512MB", "4G", "1.5GB", "1000")] == [512 << 20, 4 << 30, 3 << 29, 1000]


def test_log_level_warning_leaves_out_the_access_log(pipe):
    for level, lines in ((logging.INFO, 1), (logging.WARNING, 0)):
        log = io.StringIO()
        with serving(pipe, log, log_level=level) as (_, _, client):
            client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=2)
        assert log.getvalue().count('"POST /v1/completions') == lines
