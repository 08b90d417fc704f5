"""`mirror-mlx serve` as apps use it, end to end: a real `python -m mirror_mlx serve` subprocess and the
real `openai` client. Tool calls (a tiny model trained here to write one), log-probabilities against
mlx-lm's `generate_step`, the prefix cache within and across conversations, CORS by origin.

The tool-calling target is a 2-layer llama trained from scratch in the fixture below (seeded, 80 Adam
steps, a few seconds on a CPU) to write exactly `CALL` after the weather question and a fixed answer after
each tool result; it uses the demo pair's 512-token tokenizer (mirror_mlx/demo/ATTRIBUTION.md) with a
Qwen-like chat template whose `<tool_call>` markers mlx-lm recognizes (json_tools), so the demo draft
(llama2xs, same tokenizer) speculates for it. Nothing forces its tokens: the server decodes them itself.
"""

import json
import shutil
import signal
import urllib.error
import urllib.request

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import openai
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import load_tokenizer, save_config, save_model

from tests import leaks
from tests.models import CALL, CONFIGS, DRAFT_PATH, TARGET_PATH, TOOL_TEMPLATE, WEATHER, tiny_model
from tests.support import reference_greedy
from tests.support.servers import client, running, stop_server

PROMPT = "Once upon a time"
ASK = [{"role": "developer", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}]
ANSWERS = {'{"sky": "sunny"}': "It is sunny in Paris.", '{"sky": "rain"}': "Take an umbrella."}
TOOL_MODEL = dict(CONFIGS["llama_tied"], vocab_size=512, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)


def after_call(result: str, call_id: str = "call_0") -> list[dict]:
    """ASK, the assistant's call (as the `openai` client sends it back) and the tool's result."""
    call = {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    return ASK + [{"role": "assistant", "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": call_id, "content": result}]


def rendered(tokenizer, messages: list[dict]) -> list[int]:
    """mlx-lm's own rendering of what the server is sent ("developer" is the system role; arguments as
    objects, as templates iterate them)."""
    out = []
    for m in messages:
        m = dict(m, role="system" if m["role"] == "developer" else m["role"])
        if "tool_calls" in m:
            m["content"] = ""
            m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=json.loads(c["function"]["arguments"])))
                               for c in m["tool_calls"]]
        out.append(m)
    return list(tokenizer.apply_chat_template(out, tools=WEATHER, add_generation_prompt=True))


def train_tool_target(folder, steps: int = 80, seed: int = 0):
    """The tool-calling target: TOOL_MODEL memorizes each (prompt, reply + EOS) with Adam, loss on the
    reply only; saved as an mlx-lm folder with the demo tokenizer and TOOL_TEMPLATE."""
    shutil.copytree(TARGET_PATH, folder, ignore=shutil.ignore_patterns("model.safetensors", "config.json"))
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), chat_template=TOOL_TEMPLATE)))
    tok = load_tokenizer(folder)
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>"  # mlx-lm's detection
    eos = tok.eos_token_id
    pairs = [(rendered(tok, ASK), tok.encode(CALL, add_special_tokens=False) + [eos])]
    pairs += [(rendered(tok, after_call(r)), tok.encode(a, add_special_tokens=False) + [eos]) for r, a in ANSWERS.items()]
    width = max(len(p) + len(a) for p, a in pairs) - 1
    pad = [[0] * (width + 1 - len(p) - len(a)) for p, a in pairs]
    x = mx.array([(p + a)[:-1] + z for (p, a), z in zip(pairs, pad)])
    y = mx.array([(p + a)[1:] + z for (p, a), z in zip(pairs, pad)])
    w = mx.array([[0.0] * (len(p) - 1) + [1.0] * len(a) + [0.0] * len(z) for (p, a), z in zip(pairs, pad)])

    def loss(model):
        return (nn.losses.cross_entropy(model(x), y, reduction="none") * w).sum() / w.sum()

    model = tiny_model("llama_tied", seed, **TOOL_MODEL)
    opt = optim.Adam(learning_rate=3e-3)  # (1e-2 is unstable for some seeds)
    step = nn.value_and_grad(model, loss)
    for _ in range(steps):
        _, grads = step(model)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
    for p, a in pairs:  # it learned its lines (else the server's test below would say nothing)
        assert reference_greedy(model, p, len(a) + 2, eos=(eos,)) == a, \
            "the tool-calling test model did not memorize its replies"
    save_model(folder, model)
    save_config(dict(TOOL_MODEL), folder / "config.json")
    return folder, tok, pairs


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-serve")
    folder, tok, pairs = train_tool_target(root / "tool-llama")
    with running(root / "server.log", "--model", str(folder), "--draft-model", str(DRAFT_PATH),
                 "--mode", "mirror", "--kappa", "4", "--gamma", "3") as (proc, url):
        yield openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60), tok, pairs
        assert stop_server(proc) == 0
        made = leaks.made_in((root / "server.log").read_text())
        assert made and leaks.wait_unlinked(made) == [], "the server left a shared-memory segment behind"


@pytest.fixture(scope="module")
def demo_server(serve):
    """The demo pair; mirror with fixed knobs by default (auto would calibrate first): (a client, the URL, the log).
    Stopped with SIGTERM at the end (conftest.serve checks it ends cleanly, leaving no shared memory)."""
    served = serve("--mode", "mirror", "--kappa", "4", "--gamma", "3", stop=signal.SIGTERM)
    return client(served.url), served.url, served.log


@pytest.fixture(scope="module")
def target():
    """The demo target through mlx-lm itself, for the references."""
    return load(str(TARGET_PATH))


# --- tool calls -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["mirror", "sd", "ar"])
def test_tool_call_round_trip_with_a_model_that_writes_the_call(tool_server, mode):
    client, tok, pairs = tool_server
    kw = dict(model="tool-llama", tools=WEATHER, max_tokens=100, temperature=0, extra_body={"mode": mode})
    r = client.chat.completions.create(messages=ASK, logprobs=True, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [tc] = choice.message.tool_calls
    assert tc.type == "function" and tc.id and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "Paris"}
    # the target's greedy tokens, one for one: the call it was trained to write after this prompt, then EOS
    assert r.usage.prompt_tokens == len(pairs[0][0])
    assert [c.model_extra["id"] for c in choice.logprobs.content] == pairs[0][1]
    assert r.model_extra["x_mirror"]["mode"] == mode

    events = list(client.chat.completions.create(messages=ASK, stream=True, **kw))
    calls = [c for e in events if e.choices for c in (e.choices[0].delta.tool_calls or [])]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(0, "get_weather", {"city": "Paris"})]
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == ""  # no markup as text
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "tool_calls"

    # the app runs the tool and sends back the call and its result; the answer follows the result
    for result, answer in ANSWERS.items():
        messages = ASK + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": tc.id, "content": result}]
        r2 = client.chat.completions.create(messages=messages, **kw)
        assert r2.choices[0].message.content == answer and r2.choices[0].finish_reason == "stop"
        assert not r2.choices[0].message.tool_calls
        assert r2.usage.prompt_tokens == len(rendered(tok, after_call(result)))


# --- log-probabilities ------------------------------------------------------------------------------


def reference(model, ids: list[int], n: int, penalty=None) -> list[tuple[int, mx.array]]:
    processors = make_logits_processors(repetition_penalty=penalty) if penalty else None
    steps = generate_step(mx.array(ids), model, logits_processors=processors)
    return [(int(t), lp) for (t, lp), _ in zip(steps, range(n))]


@pytest.mark.parametrize("mode", ["mirror", "sd", "ar"])
def test_logprobs_equal_mlx_lm_generate_step(demo_server, target, mode):
    client = demo_server[0]
    model, tok = target
    ids = tok.encode(PROMPT)
    extra = {"mode": mode, "repetition_penalty": 1.5}
    ref = reference(model, ids, 24, penalty=1.5)
    r = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": PROMPT}],
                                       max_tokens=24, temperature=0, logprobs=True, top_logprobs=3, extra_body=extra)
    assert r.usage.prompt_tokens == len(ids)
    content = r.choices[0].logprobs.content
    assert [c.model_extra["id"] for c in content] == [t for t, _ in ref]
    for c, (t, lp) in zip(content, ref):
        assert abs(c.logprob - lp[t].item()) < 1e-4
        best = mx.argsort(-lp)[:3].tolist()
        assert [x.token for x in c.top_logprobs] == tok.convert_ids_to_tokens(best)
        assert [x.logprob for x in c.top_logprobs] == pytest.approx(lp[mx.array(best)].tolist(), abs=1e-4)

    # completions, the prompt as token ids, streamed: the same numbers
    events = list(client.completions.create(model="stories260K", prompt=ids, max_tokens=24, temperature=0,
                                            logprobs=2, stream=True, extra_body=extra))
    streamed = [x for e in events if e.choices and e.choices[0].logprobs for x in e.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx([lp[t].item() for t, lp in ref], abs=1e-4)


# --- the prefix cache -------------------------------------------------------------------------------

DOC = ("The little robot lived in a garden full of tall sunflowers. Every morning it watered the flowers, "
       "counted the bees and sang a song about the sun. One day a small bird landed on its head.")
OTHERS = ["A cat sat on a mat and looked at the moon.", "The sea was calm and the boat was slow."]


def ask(client, doc: str, question: str):
    return client.chat.completions.create(model="stories260K", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": doc}, {"role": "user", "content": question}])


def test_a_repeated_prefix_and_one_from_two_conversations_earlier_report_cached_tokens(demo_server, target):
    client = demo_server[0]
    model, tok = target
    doc = len(tok.encode(DOC))
    first = ask(client, DOC, "What did the robot do?")
    assert first.usage.prompt_tokens_details.cached_tokens < doc  # nothing of it was seen before
    again = ask(client, DOC, "Who sang?")  # the same document, a new question
    assert again.usage.prompt_tokens_details.cached_tokens >= doc
    for other in OTHERS:  # two other conversations in between
        assert ask(client, other, "Why?").usage.prompt_tokens_details.cached_tokens < doc // 4
    last = ask(client, DOC, "Who landed on its head?")
    assert last.usage.prompt_tokens_details.cached_tokens >= doc
    assert last.model_extra["x_mirror"]["prefix_cache_tokens"] >= doc
    # what the stored cache gave is the target's own greedy text
    ids = tok.encode(DOC) + tok.encode("Who landed on its head?", add_special_tokens=False)
    assert last.usage.prompt_tokens == len(ids)
    assert last.choices[0].message.content == tok.decode(reference_greedy(model, ids, 8, eos=(tok.eos_token_id,)))
    assert "prefix cache: the target started from a stored cache" in demo_server[2].read_text()


# --- CORS -------------------------------------------------------------------------------------------


def call(url: str, method: str, origin: str, body=None) -> tuple[int, dict]:
    raw = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, raw, method=method, headers={"Origin": origin, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        assert json.loads(e.read())["error"]["code"] == "origin_not_allowed"
        return e.code, dict(e.headers)


def test_foreign_origin_gets_no_cors_grant_by_default_and_a_local_one_does(demo_server):
    url = demo_server[1]
    body = {"prompt": PROMPT, "max_tokens": 2}
    for origin in ("http://localhost:5173", "http://127.0.0.1:3000"):
        for method, path in (("OPTIONS", "/completions"), ("POST", "/completions"), ("GET", "/models")):
            status, headers = call(url + path, method, origin, body if method == "POST" else None)
            assert status in (200, 204) and headers["Access-Control-Allow-Origin"] == origin
    for origin in ("https://evil.example", "http://localhost.evil.example", "null"):
        for method, path in (("OPTIONS", "/completions"), ("POST", "/completions"), ("GET", "/models")):
            status, headers = call(url + path, method, origin, body if method == "POST" else None)
            assert status == 403 and "Access-Control-Allow-Origin" not in headers
