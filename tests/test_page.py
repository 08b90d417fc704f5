"""The chat page at `mirror-mlx serve`'s `/`, in a real browser (headless Chromium driven by Selenium: tests/browser.py)
against a real server; the step records it draws (`x_timeline`); `generate --timeline`'s file."""

import json
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mirror_mlx.engine.stats import Stats, Step
from mirror_mlx.timeline import Steps, lanes
from tests import browser

PROMPT, SECOND = "Once upon a time", "The dog barked."
WHY_NOT = browser.missing()
needs_browser = pytest.mark.skipif(WHY_NOT is not None and not browser.must_run(), reason=str(WHY_NOT))


@pytest.fixture(scope="module")
def server(serve):
    """A real `mirror-mlx serve` of the demo pair, speculating (so the draft's lane has bars): (base URL, log)."""
    served = serve("--mode", "mirror", "--kappa", "8", "--gamma", "7")
    return served.base, served.log


@pytest.fixture(scope="module")
def web():
    assert WHY_NOT is None, WHY_NOT  # (under CI on Linux as root, the set-up must have installed the browser)
    with browser.chromium(1200, 800, ("--host-resolver-rules=MAP evil.test 127.0.0.1",)) as w:
        w.set_page_load_timeout(30)
        yield w


def api(base: str, messages: list, max_tokens: int) -> tuple[str, list[int], str]:
    """The API's greedy reply to `messages`: (text, token ids without a closing end-of-sequence, finish reason)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "logprobs": True}
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        choice = json.loads(r.read())["choices"][0]
    ids = [t["id"] for t in choice["logprobs"]["content"]]
    return choice["message"]["content"], ids[:-1] if choice["finish_reason"] == "stop" else ids, choice["finish_reason"]


def wait(web, check, seconds: float = 60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(web, seconds, poll_frequency=0.05).until(lambda w: w.execute_script(check))


def say(web, text: str) -> dict:
    """Type `text`, send it with Enter, wait for the reply; the reply's text, token ids and the picture's state."""
    from selenium.webdriver.common.keys import Keys

    n = web.execute_script("return document.querySelectorAll('.msg.assistant').length")
    web.find_element("id", "input").send_keys(text, Keys.ENTER)
    wait(web, f"return document.querySelectorAll('.msg.assistant .body[data-done]').length > {n}")
    return web.execute_script("""
        const body = [...document.querySelectorAll('.msg.assistant .body')].pop();
        const svg = document.getElementById('timeline');
        return {text: body.textContent, ids: body.dataset.ids ? body.dataset.ids.split(',').map(Number) : [],
                drafted: body.querySelectorAll('.tok.draft').length, steps: +svg.dataset.steps,
                bars: [...svg.querySelectorAll('rect.bar')].map(r => r.classList[1]),
                numbers: document.getElementById('numbers').textContent,
                status: document.getElementById('status').textContent};""")


def set_field(web, name: str, value: str) -> None:
    from selenium.webdriver.common.keys import Keys

    field = web.find_element("id", name)
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(value)


@needs_browser
def test_the_page_chats_with_the_api_s_replies_and_draws_each_step(server, web, tmp_path):
    from selenium.webdriver.common.keys import Keys

    server = server[0]
    web.get(server + "/")
    wait(web, "return document.getElementById('model').textContent === 'stories260K'")
    assert web.execute_script("return document.activeElement.id") == "input"  # type at once
    order = []
    for _ in range(4):  # the keyboard's way through the page: the message, send, then the settings
        web.switch_to.active_element.send_keys(Keys.TAB)
        order.append(web.execute_script("return document.activeElement.id"))
    assert order == ["send", "temperature", "max-tokens", "new"]  # (stop is disabled while nothing streams)
    set_field(web, "max-tokens", "40")
    web.find_element("id", "input").send_keys("first line", Keys.SHIFT, Keys.ENTER)  # Shift+Enter: a new line
    assert web.execute_script("return document.querySelectorAll('.msg').length") == 0
    web.find_element("id", "input").clear()

    first = say(web, PROMPT)
    text, ids, _ = api(server, [{"role": "user", "content": PROMPT}], 40)
    assert first["text"] == text and first["ids"] == ids  # token for token
    assert first["steps"] > 0 and {"prefix", "suffix", "rollout"} <= set(first["bars"])
    assert first["drafted"] > 0 and "tokens/s" in first["numbers"] and "mirror κ=8 γ=7" in first["numbers"]
    web.save_screenshot(str(tmp_path / "page.png"))
    assert (tmp_path / "page.png").stat().st_size > 10_000

    # a second turn: the same request through the API (the server then holds the same first turn)
    second = say(web, SECOND)
    api(server, [{"role": "user", "content": PROMPT}], 40)
    turn = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": first["text"]},
            {"role": "user", "content": SECOND}]
    text, ids, _ = api(server, turn, 40)
    assert second["text"] == text and second["ids"] == ids

    # a new conversation empties the page; Stop (Esc) keeps what came
    web.find_element("id", "new").click()
    assert web.execute_script("return document.querySelectorAll('.msg').length") == 0
    set_field(web, "max-tokens", "400")
    web.find_element("id", "input").send_keys("Lily and Tom", Keys.ENTER)
    wait(web, "return [...document.querySelectorAll('.msg.assistant .body')].pop().textContent.length > 0")
    web.find_element("id", "input").send_keys(Keys.ESCAPE)
    wait(web, "return document.getElementById('log').dataset.state === 'idle'")
    assert web.execute_script("return document.getElementById('status').textContent") == "stopped"
    web.find_element("id", "new").click()

    # a narrow window: one column, nothing wider than the window, and it still chats
    web.set_window_size(400, 800)
    set_field(web, "max-tokens", "12")
    narrow = say(web, PROMPT)
    assert narrow["text"] == api(server, [{"role": "user", "content": PROMPT}], 12)[0] and narrow["steps"] > 0
    assert web.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    assert web.execute_script("const r = document.getElementById('timeline').getBoundingClientRect();"
                              "return r.width > 0 && r.right <= window.innerWidth")


@needs_browser
def test_a_page_at_an_origin_not_allowed_gets_no_page(server, web, tmp_path):
    server, log = server
    port = server.rsplit(":", 1)[1]
    web.get(f"http://evil.test:{port}/")  # a name that resolves to this machine (DNS rebinding's trick)
    assert not web.find_elements("id", "input") and "not served" in web.find_element("tag name", "body").text
    # another site's page that frames the chat page and posts to the API: the server gives it neither
    (tmp_path / "other.html").write_text(f'<iframe id="f" src="{server}/"></iframe><script>fetch("{server}/v1/chat/'
                                         'completions", {method: "POST", headers: {"Content-Type": "application/json"},'
                                         f' body: \'{{"messages": [{{"role": "user", "content": "hi"}}]}}\'}})'
                                         '.then(r => document.title = "got " + r.status, e => document.title = '
                                         '"refused");</script>')
    other = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(tmp_path)))
    threading.Thread(target=other.serve_forever, daemon=True).start()
    refused = lambda: log.read_text().count('"GET / HTTP/1.1" 403')  # noqa: E731  (the access log)
    before = refused()
    try:
        web.get(f"http://evil.test:{other.server_address[1]}/other.html")
        wait(web, "return document.title === 'refused'", 30)
    finally:
        other.shutdown()
    assert refused() == before + 1  # the frame's request
    for headers in ({"Origin": "https://evil.test"}, {"Host": f"evil.test:{port}"},
                    {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Dest": "iframe"}):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(server + "/", headers=headers), timeout=30)
        answer = json.loads(e.value.read())
        assert e.value.code == 403 and answer["error"]["code"] == "origin_not_allowed"


def test_generate_timeline_writes_one_file_of_the_run(tmp_path):
    out = tmp_path / "run.html"
    r = subprocess.run([sys.executable, "-m", "mirror_mlx", "generate", "--max-tokens", "24", "--mode", "mirror",
                        "--kappa", "8", "--gamma", "7", "--timeline", str(out), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    done = json.loads(r.stdout.strip().splitlines()[-1])
    page = out.read_text()
    assert "<script src" not in page and "<link" not in page  # self-contained: opens offline, anywhere
    run = json.loads(re.search(r'<script type="application/json" id="run">(.*?)</script>', page, re.S).group(1))
    assert run["text"] == done["text"]
    assert [t[2] for s in run["steps"] for t in s["tokens"]] == done["tokens"]
    assert len(run["steps"]) == done["stats"]["steps"] and all("suffix" in s for s in run["steps"])
    assert sum("prefix" in s and "rollout" in s for s in run["steps"]) >= len(run["steps"]) - 1  # (a last step of
    # one token is the target's alone)
    assert f"wrote the timeline of {len(run['steps'])} steps to {out}" in r.stderr
    if WHY_NOT is None:  # it draws: the same script as the chat page's
        with browser.chromium(1000, 600) as w:
            w.get(out.as_uri())
            bars = w.execute_script("return document.querySelectorAll('#timeline rect.bar').length")
            assert bars >= 2 * len(run["steps"])
            assert w.execute_script("return document.getElementById('text').textContent") == done["text"]
    bad = subprocess.run([sys.executable, "-m", "mirror_mlx", "generate", "--timeline", str(tmp_path / "no" / "x.html")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "its folder does not exist" in bad.stderr


def test_each_kind_of_step_has_its_lanes():
    """sd drafts its window, then the target verifies it; a batched row is one forward; the axis starts at the
    first step."""
    sd = Step([1, 2, 3], [True, True, False], 3, 2,
              stats=Stats(mode="sd", gamma=3, draft_seconds=0.004, suffix_seconds=0.006), span=(10.0, 10.011))
    assert lanes(sd, 10.0) == {"t": [0.0, 11.0], "serial": [[0.0, 4.0]], "suffix": [5.0, 11.0]}
    steps = Steps()
    first = steps.add(sd, [1, 2, 3], ["a", "b", "c"], [True, True, False])
    assert first["knobs"] == "sd γ=3" and first["tokens"] == [["a", 1, 1], ["b", 1, 2], ["c", 0, 3]]
    batch = Step([4], [False], stats=Stats(mode="batch", suffix_seconds=0.002), span=(10.02, 10.022))
    row = steps.add(batch, [4], ["d"], [False])
    assert row["n"] == 2 and row["mode"] == "batch" and row["suffix"] == [20.0, 22.0] and row["serial"] == []
    assert (first["committed"], row["committed"]) == (3, 1)
    assert "knobs" not in steps.add(batch, [5], ["e"], [False])  # said once, until it changes
