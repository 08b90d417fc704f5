"""`mirror-mlx serve` under concurrent requests: a request alone speculates; several decode together in
mlx-lm's BatchGenerator, joining and leaving at step boundaries, each with the text it gets alone.
A real server in a subprocess (the demo pair, speculating: mode mirror), the real `openai` client;
/health and each reply's x_mirror say which regime ran, so every test sees that the batch happened."""

import signal
import threading

import openai
import pytest

from tests.support.servers import SPECULATE, health, rest, running, stop_server, stream_first, wait_for

PROMPTS = ["Once upon a time", "The dog barked.", "Tom and Lily", "One day, a little bird"]


@pytest.fixture(scope="module")
def server(serve):
    """Speculating (mode mirror, knobs given); stopped with SIGTERM at the end (conftest.serve checks how)."""
    return serve(*SPECULATE, stop=signal.SIGTERM)


@pytest.fixture(scope="module")
def alone(client):
    """Each request's text run alone (nothing else active; the target alone, mode ar, which every mode equals
    token for token), computed once per (prompt, max_tokens, extra)."""
    done: dict = {}

    def text(prompt: str, max_tokens: int, **extra) -> str:
        key = (prompt, max_tokens, tuple(sorted(extra.items())))
        if key not in done:
            r = client.completions.create(model="stories260K", prompt=prompt, max_tokens=max_tokens,
                                          extra_body={"mode": "ar"}, **extra)
            assert r.model_extra["x_mirror"]["regimes"] == ["ar"], r.model_extra["x_mirror"]  # it ran alone
            done[key] = r.choices[0].text
        return done[key]

    return text


def test_concurrent_requests_are_batched_and_equal_their_texts_alone(server, client, alone):
    seeded = {"temperature": 0.8, "seed": 11}
    want = [alone(p, 96, **(seeded if i == 3 else {})) for i, p in enumerate(PROMPTS)]
    before = health(server[0])["scheduler"]["batch_steps"]
    got: list = [None] * 4
    go = threading.Barrier(4)

    def one(i: int) -> None:
        go.wait()
        r = client.completions.create(model="stories260K", prompt=PROMPTS[i], max_tokens=96,
                                      **(seeded if i == 3 else {}))
        got[i] = (r.choices[0].text, r.model_extra["x_mirror"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert [g[0] for g in got] == want  # greedy ones token for token; the seeded one draws the same tokens
    assert all("batch" in g[1]["regimes"] and g[1]["batched_tokens"] > 0 for g in got), [g[1]["regimes"] for g in got]
    h = health(server[0])["scheduler"]
    assert h["batch_steps"] > before and h["max_batch"] >= 3, h


def test_a_request_joins_a_running_batch(server, client, alone):
    want = [alone(PROMPTS[0], 300), alone(PROMPTS[1], 300), alone(PROMPTS[2], 24)]
    a, a0 = stream_first(client, PROMPTS[0], 300)
    b, b0 = stream_first(client, PROMPTS[1], 300)
    wait_for(lambda: health(server[0])["regime"] == "batch" and health(server[0])["active"] == 2, server[1])
    joins = health(server[0])["scheduler"]["joins"]
    r = client.completions.create(model="stories260K", prompt=PROMPTS[2], max_tokens=24)
    assert r.model_extra["x_mirror"]["regimes"] == ["batch"]  # it never decoded alone
    assert health(server[0])["scheduler"]["joins"] == joins + 1
    assert [r.choices[0].text, rest(a, [a0])[0], rest(b, [b0])[0]] == [want[2], want[0], want[1]]


def test_a_speculating_request_moves_into_the_batch_and_back(server, client, alone):
    want = [alone(PROMPTS[0], 300), alone(PROMPTS[3], 20)]
    events, first = stream_first(client, PROMPTS[0], 300)
    parts = [first] + [next(iter(events)).choices[0].text for _ in range(2)]  # speculating alone meanwhile
    h = health(server[0])["scheduler"]
    other = client.completions.create(model="stories260K", prompt=PROMPTS[3], max_tokens=20)
    assert other.model_extra["x_mirror"]["regimes"] == ["batch"]
    text, stats = rest(events, parts)
    assert stats["regimes"] == ["mirror", "batch", "mirror"], stats["regimes"]  # into the batch, and back
    assert 0 < stats["batched_tokens"] < 300 and stats["mode"] == "mirror"
    after = health(server[0])["scheduler"]
    assert after["moves_in"] == h["moves_in"] + 1 and after["moves_out"] == h["moves_out"] + 1
    assert after["moves_prefilled"] == 0  # each move carried the target's cache over: nothing prefilled again
    assert [text, other.choices[0].text] == want


def test_a_client_that_disconnects_mid_batch_frees_its_slot(server, client, alone):
    want = alone(PROMPTS[1], 300)
    keep, k0 = stream_first(client, PROMPTS[1], 300)
    gone, _ = stream_first(client, PROMPTS[2], 400)
    wait_for(lambda: health(server[0])["active"] == 2 and health(server[0])["regime"] == "batch", server[1])
    before = health(server[0])
    gone.close()  # the client goes away mid-batch
    wait_for(lambda: health(server[0])["scheduler"]["freed"] == before["scheduler"]["freed"] + 1, server[1])
    h = health(server[0])
    assert h["scheduler"]["freed_in_batch"] == before["scheduler"]["freed_in_batch"] + 1  # freed from the batch
    assert h["disconnected"] == before["disconnected"] + 1 and h["active"] <= 1
    assert rest(keep, [k0])[0] == want  # the other request is not disturbed


def test_under_the_byte_limit_stored_prompt_caches_give_way_to_the_active_batch(tmp_path):
    """--prompt-cache-bytes bounds the stored caches and the active batch's caches together (as mlx_lm.server)."""
    log = tmp_path / "server.log"
    with running(log, *SPECULATE, "--prompt-cache-bytes", "400KB") as (proc, url):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        # alone, stored; mode ar, so the rate measured alone is one token per forward and two rows batched
        # beat it by about 2x (a speculating request's rate alone can come near a batch's on a loaded box)
        client.completions.create(model="stories260K", prompt="A bird sang.", max_tokens=8, extra_body={"mode": "ar"})
        stored = health(url)["prefix_cache"]
        assert stored["entries"] == 1 and stored["bytes"] <= stored["max_bytes"] < 2 * stored["bytes"], stored
        a, a0 = stream_first(client, PROMPTS[0], 300)
        b, b0 = stream_first(client, PROMPTS[1], 300)
        wait_for(lambda: health(url)["regime"] == "batch" and health(url)["active"] == 2, log)
        during = health(url)["prefix_cache"]  # two rows' caches leave no room for the stored one
        assert during["dropped_for_batch"] == 1 and during["entries"] == 0, during
        rest(a, [a0]), rest(b, [b0])
        assert stop_server(proc) == 0  # (a clean stop: the draft host closes its shared memory)


def test_each_switch_follows_the_measured_costs():
    """Batching pays when n rows per measured batched step beat the rate measured alone; the last request
    leaves the batch when alone measured faster than a batch of one; both say why, with the numbers."""
    from mirror_mlx.server.scheduler import Costs
    from mirror_mlx.engine.stats import Stats

    costs = Costs()
    assert costs.batch_pays(2, None)[0]  # nothing measured alone yet: batch (mlx_lm.server's choice)
    costs.note_solo(Stats(generation_tokens=100, decode_seconds=0.5, target_forwards=50, suffix_seconds=0.4))
    assert costs.solo_rate == pytest.approx(200) and costs.solo_forward == pytest.approx(0.008)
    pays, why = costs.batch_pays(2, costs.solo_rate)  # no batched step measured: one forward alone's time
    assert pays and "250 tok/s vs 200 tok/s alone" in why and "one forward alone's" in why
    costs.note_batch(2, 0.02)  # measured: 100 tok/s batched, slower than alone
    assert not costs.batch_pays(2, costs.solo_rate)[0]
    assert costs.batch_pays(4, 100)[1].endswith("(4 rows / 20.00 ms per step (as measured at 2 rows) = 200 tok/s "
                                                 "vs 100 tok/s alone)")
    assert costs.solo_pays()[0]  # (batch of one not measured: alone, as a request alone runs)
    costs.note_batch(1, 0.001)  # 1000 tok/s as a batch of one
    assert costs.solo_pays() == (False, "one request: stays batched (200 tok/s alone vs 1000 tok/s as a batch "
                                        "of one)")
