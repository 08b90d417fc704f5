"""Speculation inside the server's batch (server/spec_batch.py): every busy row verifies its own window (its
prompt lookup's, or with the recycled draft the recycled chain) in one batched forward and keeps exactly its
own accepted tokens. Through a real server and the real
`openai` client, each row's text equals mlx-lm's greedy generation of its prompt alone while rows of different
lengths join and leave mid-batch; a request arriving during a speculating batch starts at the next step; above
temperature 0 a row in a busy batch follows the target's distribution (the whole-generation test of
tests/test_sampling_whole.py); the width choice follows given costs."""

import signal
import threading

import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm import generate as mlx_generate
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import greedy_sampler, make_sampler

from mirror_mlx.demo import TARGET
from mirror_mlx.options import DecodeOptions
from mirror_mlx.engine.sampling import row_sampler
from mirror_mlx.proposers.recycle import Recycled
from mirror_mlx.server.spec_batch import SpecBatch, VerifyCost, choose_width, supports
from tests.models import tiny_model
from tests.support.servers import SPECULATE, health, rest, running, stop_server, stream_first, wait_for
from tests.support.whole_sampling import KNOBS, PROMPT, SHAPE, V, conditional_test, processed_probs, rows_in_step

STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
PROMPTS = [STORY * 3 + "Once upon a time", "The dog barked. " * 4 + "The dog", STORY + "One day,",
           "Tom and Lily went to the park. Tom and Lily"]
LENGTHS = [120, 60, 90, 40]  # different lengths: rows leave the batch at different steps
LENGTHS_IN = [60, 45, 50, 20]  # (the in-process batches')


@pytest.fixture(scope="module")
def server(serve):
    """The batch tests' server (tests/test_server_batch.py): speculating, stopped with SIGTERM at the end."""
    return serve(*SPECULATE, stop=signal.SIGTERM)


@pytest.fixture(scope="module")
def greedy():
    """mlx-lm's own greedy generation of a prompt alone (mlx_lm.generate: its text, stopping at end of sequence)."""
    model, tokenizer = mlx_load(str(TARGET))
    return lambda prompt, n: mlx_generate(model, tokenizer, prompt, max_tokens=n)


@pytest.fixture(scope="module")
def demo():
    """The demo target, PROMPTS as its token ids, and mlx-lm's greedy tokens of each alone (LENGTHS_IN)."""
    model, tokenizer = mlx_load(str(TARGET))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    want = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=n, sampler=greedy_sampler)]
            for p, n in zip(prompts, LENGTHS_IN)]
    return model, prompts, want


def joining_and_leaving(batch: SpecBatch, prompts: list, finished=None) -> list[list[int]]:
    """Each prompt's tokens (LENGTHS_IN) from `batch`: two start, the others join at steps 3 and 7, rows leave as
    they finish (`finished` sees each finished row's Out)."""
    got: dict = {}
    uids = {batch.insert(p, 0, None, DecodeOptions(max_tokens=n), n): i
            for i, (p, n) in enumerate(zip(prompts[:2], LENGTHS_IN[:2]))}
    step = 0
    while batch.rows or batch.joining or len(uids) < 4:
        if step in (3, 7):  # joining mid-batch
            i = len(uids)
            uids[batch.insert(prompts[i], 0, None, DecodeOptions(max_tokens=LENGTHS_IN[i]), LENGTHS_IN[i])] = i
        for out in batch.next()[1]:
            got.setdefault(uids[out.uid], []).extend(out.tokens)
            if out.finish and finished is not None:
                finished(out)
        step += 1
    return [got[i] for i in range(4)]


def concurrently(server, client) -> list:
    """PROMPTS' completions (LENGTHS) as (text, x_mirror): three at once, the fourth joining the running batch."""
    got: list = [None] * 4
    go = threading.Barrier(3)

    def one(i: int) -> None:
        if i < 3:
            go.wait()
        r = client.completions.create(model="stories260K", prompt=PROMPTS[i], max_tokens=LENGTHS[i])
        got[i] = (r.choices[0].text, r.model_extra["x_mirror"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    [t.start() for t in threads]
    wait_for(lambda: health(server[0])["regime"] == "batch", server[1])
    late = threading.Thread(target=one, args=(3,))  # joins the running batch mid-way
    late.start()
    [t.join(120) for t in threads + [late]]
    return got


def test_rows_joining_and_leaving_a_speculating_batch_each_equal_mlx_lm_alone(server, client, greedy):
    want = [greedy(p, n) for p, n in zip(PROMPTS, LENGTHS)]
    before = health(server[0])["scheduler"]["batch_speculation"]
    got = concurrently(server, client)
    assert [g[0] for g in got] == want
    assert got[3][1]["regimes"] == ["batch"], got[3][1]
    spec = health(server[0])["scheduler"]["batch_speculation"]
    assert spec["on"] is True, spec
    # it speculated and windows were accepted (each row's own: accepted tokens differ by row)
    assert spec["speculative_steps"] > before.get("speculative_steps", 0), spec
    assert spec["accepted"] > before.get("accepted", 0), spec
    assert sum(g[1]["batch_accepted"] for g in got) > 0 and len({g[1]["batch_accepted"] for g in got}) > 1, got


def test_a_server_of_the_recycled_draft_proposes_recycled_chains_in_its_batch(tmp_path, greedy):
    """`serve --draft-model recycle`: batched rows propose the recycled chains from the table the solo trees
    fill too; /health counts what each proposer offered and had accepted, and every text is mlx-lm's alone."""
    want = [greedy(p, n) for p, n in zip(PROMPTS, LENGTHS)]
    with running(tmp_path / "server.log", "--draft-model", "recycle") as (proc, url):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        for _ in range(2):  # (the second round's rows find the table the first filled)
            assert [g[0] for g in concurrently((url, tmp_path / "server.log"), client)] == want
        spec = health(url)["scheduler"]["batch_speculation"]
        assert spec["on"] is True and spec["recycle"] is True, spec
        assert spec["recycled_proposed"] > 0 and spec["recycled_accepted"] > 0, spec
        assert spec["lookup_proposed"] + spec["recycled_proposed"] == spec["proposed"], spec
        assert stop_server(proc) == 0


def test_a_request_arriving_during_a_speculating_batch_starts_at_the_next_step(server, client, greedy):
    a, a0 = stream_first(client, PROMPTS[0], 300)
    b, b0 = stream_first(client, PROMPTS[1], 300)
    wait_for(lambda: health(server[0])["regime"] == "batch" and health(server[0])["active"] == 2, server[1])
    r = client.completions.create(model="stories260K", prompt=PROMPTS[2], max_tokens=16)
    stats = r.model_extra["x_mirror"]
    assert stats["regimes"] == ["batch"]
    # the step in flight when it arrived, then the step it joined (its prefill and first token)
    assert 1 <= stats["steps_to_first_token"] <= 2, stats
    assert r.choices[0].text == greedy(PROMPTS[2], 16)
    assert [rest(a, [a0])[0], rest(b, [b0])[0]] == [greedy(PROMPTS[0], 300), greedy(PROMPTS[1], 300)]


@pytest.mark.parametrize("recycle", [False, True])
def test_a_row_in_a_busy_batch_follows_the_target_distribution(recycle):
    """40 seeded generations of PROMPT, each a row of a batch with two other rows that join and leave around it;
    every committed token is checked against its exact processed distribution (test_sampling_whole's test),
    and the seeded draws are those the target alone makes (sampling.position_seed). With the recycled table,
    rows verify recycled chains too."""
    target = tiny_model("llama_tied", seed=11, **SHAPE)
    settings = dict(temperature=1.0, top_k=5)
    outputs, rows = [], []
    seen = {"accepted": 0, "speculative_steps": 0, "recycled_proposed": 0, "recycled_accepted": 0}
    batch = SpecBatch(target, gamma=KNOBS["gamma"], recycled=Recycled(V) if recycle else None)
    for seed in range(40):
        mine = batch.insert(list(PROMPT), 0, None, DecodeOptions(max_tokens=20, seed=seed, **settings), 20)
        others = [batch.insert([5, 2, 6, 5, 2][: 2 + seed % 4], 0, None,
                               DecodeOptions(max_tokens=n, seed=seed + 100), n) for n in (7 + seed % 5, 31)]
        tokens, drafted = [], []
        while batch.rows or batch.joining:
            for out in batch.next()[1]:
                if out.uid == mine:
                    tokens += out.tokens
                    drafted += out.drafted
        batch.remove(others)
        assert len(tokens) == 20
        outputs.append(tokens)
        rows.append(rows_in_step(drafted))
    for k in seen:
        seen[k] = batch.health()[k]
    outputs, rows = np.array(outputs), np.array(rows)
    assert seen["speculative_steps"] >= 20 and seen["accepted"] >= 20, seen  # windows verified, some accepted
    assert (seen["recycled_accepted"] >= 10) if recycle else (seen["recycled_proposed"] == 0), seen
    probs = processed_probs(target, outputs, **settings)
    previous = np.concatenate([np.full((len(outputs), 1), PROMPT[-1]), outputs[:, :-1]], axis=1)
    p = conditional_test(outputs.ravel(), probs.reshape(-1, V), rows.ravel(), previous.ravel())
    assert min(p.values()) > 1e-4, (p, seen)
    for seed in range(3):  # seeded: the target's own draw at each position, keyed as every mode keys it
        sample, history = row_sampler(make_sampler(1.0, top_k=5), seed), list(PROMPT)
        for _ in range(20):
            logits = target(mx.array([history]))[:, -1]
            history += sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True), len(history))
        assert history[len(PROMPT):] == outputs[seed].tolist(), seed


def test_the_width_is_the_one_with_the_most_tokens_per_second():
    """Width w costs seconds(w) and commits 1 + sum(survival[:w - 1]) per row on average; a wider step must beat
    a plain one by MARGIN (1.05); rows without a window add one token at any width."""
    flat = lambda w: 1.0  # noqa: E731 - verify widths cost the same: the widest that adds anything
    assert choose_width([[0.9, 0.8, 0.7], [0.5]], flat, 4) == 4
    assert choose_width([[], []], flat, 1) == 1
    linear = lambda w: 1.0 + 0.5 * (w - 1)  # noqa: E731 - each column costs half a plain step
    # 2 rows: w=1: 2/1; w=2: (2 + 0.9 + 0.1)/1.5 = 2.0 (not 5 % better); w=3: (2 + 1.7 + 0.1)/2 = 1.9
    assert choose_width([[0.9, 0.8], [0.1]], linear, 3) == 1
    # a copy under way: w=3: (2 + 1.9 + 1.9)/2 = 2.9, w=2: 3.9/1.5 = 2.6, w=4: (2 + 2.8 + 2.8)/2.5 = 3.04
    assert choose_width([[0.99, 0.95, 0.9], [0.99, 0.95, 0.9]], linear, 4) == 4
    cost = VerifyCost()
    assert cost.seconds(2, 3) == pytest.approx(1 + 0.1 * 5)  # nothing measured: ROW_COST per token, in plain steps
    cost.note(4, 1, 0.02)
    assert cost.seconds(4, 2) == pytest.approx(0.02 * 1.7 / 1.3)  # one size measured: ROW_COST of it per token
    cost.note(4, 1, 0.02)
    cost.note(4, 5, 0.04)
    cost.note(4, 5, 0.04)  # (a size's first measurement is replaced by its second)
    assert cost.seconds(4, 3) == pytest.approx(0.03)  # a line through the measured sizes in rows × width
    assert cost.seconds(4, 5) == pytest.approx(0.04)


def test_recurrent_or_sliding_window_layers_batch_without_speculation_and_say_why():
    assert supports(tiny_model("llama_tied")) == (True, "")
    ok, why = supports(tiny_model("mamba2"))
    assert not ok and "cannot drop a row's own rejected tokens" in why, why
    ok, why = supports(tiny_model("gemma3_text"))
    assert not ok and "sliding-window layers" in why, why


def test_with_batch_speculation_off_the_batch_decodes_one_token_a_row(tmp_path, greedy):
    log = tmp_path / "server.log"
    with running(log, *SPECULATE, "--batch-speculation", "off") as (proc, url):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        a, a0 = stream_first(client, PROMPTS[0], 200)
        r = client.completions.create(model="stories260K", prompt=PROMPTS[1], max_tokens=30)
        assert r.model_extra["x_mirror"]["regimes"] == ["batch"] and r.model_extra["x_mirror"]["batch_accepted"] == 0
        spec = health(url)["scheduler"]["batch_speculation"]
        assert spec == {"on": False, "why": "off (--batch-speculation off)"}, spec
        assert [r.choices[0].text, rest(a, [a0])[0]] == [greedy(PROMPTS[1], 30), greedy(PROMPTS[0], 200)]
        assert stop_server(proc) == 0


@pytest.mark.parametrize("squeeze", [False, True])
def test_holes_masked_or_squeezed_out_and_caches_taken_out_keep_each_row_exact(monkeypatch, squeeze, demo):
    """Rows that accept different counts leave holes in the batch cache: masked (never squeezed out here), or
    squeezed out at every step that left some. Either way rows joining and leaving get mlx-lm's greedy tokens
    alone, and a finished row's cache taken out of the batch holds exactly its tokens (the next token from it is
    the one a fresh forward gives)."""
    import mirror_mlx.server.spec_batch as spec_batch

    monkeypatch.setattr(spec_batch, "COMPACT", 1)
    monkeypatch.setattr(spec_batch.HoleKVCache, "waste", lambda self: 2 if squeeze else 0)
    squeezed = []
    monkeypatch.setattr(spec_batch.HoleKVCache, "compact",
                        lambda self, real=spec_batch.HoleKVCache.compact: squeezed.append(1) or real(self))
    model, prompts, want = demo
    batch = SpecBatch(model)

    def finished(out) -> None:
        held = out.all_tokens + out.tokens[-1:]
        assert all(c.offset == len(out.all_tokens) for c in out.cache)
        assert (model(mx.array([held[-1:]]), cache=out.cache)[0, -1].argmax().item()
                == model(mx.array([held]))[0, -1].argmax().item())

    assert joining_and_leaving(batch, prompts, finished) == want
    assert batch._holed and bool(squeezed) == squeeze, (batch._holed, len(squeezed), batch.counts)


def test_recycled_chains_are_proposed_and_accepted_and_each_row_still_equals_mlx_lm_alone(demo):
    """With the recycled table, rows whose lookup offers less propose the chain of rank-0 successors; every
    verify teaches the table (each walked position counted against its candidates), so a second batch of the
    same prompts gets chains accepted. Both give mlx-lm's greedy tokens of each prompt alone; without the table
    nothing is recycled."""
    model, prompts, want = demo
    table = Recycled(model.args.vocab_size)
    batch = SpecBatch(model, recycled=table)
    assert joining_and_leaving(batch, prompts) == want
    assert table.reached[0] > 0 and (table.table >= 0).any()
    assert joining_and_leaving(batch, prompts) == want
    spec = batch.health()
    assert spec["recycle"] and spec["recycled_proposed"] > 0 and spec["recycled_accepted"] > 0, spec
    assert spec["lookup_proposed"] + spec["recycled_proposed"] == spec["proposed"], spec
    assert spec["lookup_accepted"] + spec["recycled_accepted"] == spec["accepted"], spec
    plain = SpecBatch(model)
    assert joining_and_leaving(plain, prompts) == want
    spec = plain.health()
    assert not spec["recycle"] and spec["recycled_proposed"] == spec["recycled_accepted"] == 0, spec
    assert spec["lookup_proposed"] == spec["proposed"] > 0, spec
