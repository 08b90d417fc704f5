"""The engine: every mode returns exactly what the target alone returns, whatever the draft does."""

import copy
import time

import mlx.core as mx
import pytest
from mlx_lm import load

from mirror_mlx.drafts.mlx_draft import MLXDraft
from mirror_mlx.drafts.api import Rollout
from mirror_mlx.engine import reuse_window
from mirror_mlx.engine.target import accept
from mirror_mlx.pipeline import Pipeline, load_draft
from tests.lanes import LANES, in_lanes
from tests.models import DRAFT_PATH, TARGET_PATH, tiny_model
from tests.support import assert_lossless, FakeTokenizer, openings, reference_greedy


@pytest.fixture(scope="module")
def demo():
    """The demo pair as `load` makes it: the draft in its own host process."""
    target, tokenizer = load(str(TARGET_PATH))
    pipe = Pipeline(target, tokenizer, load_draft(DRAFT_PATH, tokenizer))
    assert pipe.engine.host.process
    yield pipe
    pipe.close()


@pytest.fixture(scope="module")
def demo_thread():
    """The demo pair with a draft object built here: the same host loop, on a thread."""
    target, tokenizer = load(str(TARGET_PATH))
    draft, _ = load(str(DRAFT_PATH))
    pipe = Pipeline(target, tokenizer, MLXDraft(draft))
    assert not pipe.engine.host.process
    yield pipe
    pipe.close()


@pytest.fixture(scope="module")
def demos(demo):
    """`demo` and a second demo pipeline with its own draft host: long loops of generations run on both."""
    target, tokenizer = load(str(TARGET_PATH))
    pipe = Pipeline(target, tokenizer, load_draft(DRAFT_PATH, tokenizer))
    yield [demo, pipe][:LANES]
    pipe.close()


@pytest.fixture(scope="module")
def greedy_refs(demo):
    prompts = [demo.tokenizer.encode(o) for o in openings(20)]
    return [(p, reference_greedy(demo.model, p, 128)) for p in prompts]


def accepted_lengths(from_draft) -> list[int]:
    """How many draft tokens each verify step accepted: the runs of drafted tokens, each closed by the
    target's own token (the first token comes from the prefill; a run cut off by max_tokens is not counted)."""
    lengths, run = [], 0
    for drafted in from_draft[1:]:
        if drafted:
            run += 1
        else:
            lengths.append(run)
            run = 0
    return lengths


GRID_TOKENS = 96  # per opening in the κ/γ/ℓe grid below
SD_SETTINGS = {(8, 7), (1, 1)}  # sd in the grid: its steps depend on γ alone (no κ, ℓe or branches): the longest
# window and the shortest


@pytest.mark.parametrize("kappa,gamma,exit_layer,branches", [(8, 7, None, None), (1, 1, 1, None), (3, 4, 4, None),
                                                             (16, 2, 2, None), (4, 3, None, 2), (4, 3, None, 5)])
def test_mirror_and_sd_equal_mlx_lm_greedy_on_20_openings(demos, greedy_refs, kappa, gamma, exit_layer, branches):
    """Mirror at every setting and sd at SD_SETTINGS decode the 16 distinct openings, GRID_TOKENS tokens each,
    exactly as mlx-lm does.

    GRID_TOKENS was 128: 96 keeps every path of a verify step exercised many times over, which is what
    the many openings are for. On the 16 openings (mirror; sd's acceptances are the same, the draft's
    greedy windows against the target's), 96 tokens still give 507 / 901 / 554 / 709 verify steps for
    the four settings below (679 / 1205 / 753 / 959 at 128), every acceptance length 0..γ at least 6
    times (κ=8 γ=7: 158, 87, 87, 85, 35, 27, 6, 22 steps accept 0..7), and mirror's reuse and fallback
    each 237 to 1,197 times per setting at 128 tokens (about three quarters of that at 96), but for
    κ=1 γ=1's reuse, 19 times at 128 tokens. No size limit sits between 96 and 128 tokens (the prompts
    are ~8 tokens; the draft's context is 256, its branch rows grow every 256, the target's context is
    512). That every acceptance length occurs is asserted. With a branch budget B (mirror only: sd has no
    branches) at most B branches are rolled out a step, and some corrections fall outside them."""
    for mode in ("mirror", "sd") if (kappa, gamma) in SD_SETTINGS else ("mirror",):
        def check(pipe, case):
            prompt, ref = case
            out = pipe.generate(prompt, max_tokens=GRID_TOKENS, kappa=kappa, gamma=gamma, exit_layer=exit_layer,
                                mode=mode, branches=branches, stop=False)
            assert_lossless(out.tokens, ref[:GRID_TOKENS],
                            f"{mode} κ={kappa} γ={gamma} ℓe={exit_layer} B={branches} diverged on {prompt}")
            if branches is not None:
                assert 0 < out.stats.branches_rolled <= branches * out.stats.steps, out.stats.as_dict()
            return accepted_lengths(out.from_draft)

        seen = {a for lengths in in_lanes(demos, greedy_refs, check) for a in lengths}
        assert seen == set(range(gamma + 1)), f"{mode} κ={kappa} γ={gamma}: the openings accepted only {sorted(seen)}"


def test_ar_mode_equals_mlx_lm_greedy(demo, greedy_refs):
    for prompt, ref in greedy_refs[:5]:
        assert_lossless(demo.generate(prompt, max_tokens=128, mode="ar", stop=False).tokens, ref)


def test_random_draft_falls_back_almost_always_and_stays_lossless(greedy_refs):
    target, tokenizer = load(str(TARGET_PATH))
    random_draft = tiny_model("llama_tied", seed=3, vocab_size=512)
    pipe = Pipeline(target, tokenizer, MLXDraft(random_draft))
    for prompt, ref in greedy_refs[:3]:
        out = pipe.generate(prompt, max_tokens=128, kappa=1, gamma=4, exit_layer=1, stop=False)
        assert_lossless(out.tokens, ref)
        assert out.stats.fallback_rate > 0.5 and out.stats.mean_accepted < 1.5
    pipe.close()


class _AskedDraft(MLXDraft):
    """A plain draft that notes, for each rollout, how many tokens the shortest window follows."""

    def __init__(self, model):
        super().__init__(model)
        self.follows: list[int] = []

    def rollout(self, context, stems, gamma) -> Rollout:
        self.follows.append(len(context) + min(len(s) for s in stems))
        return super().rollout(context, stems, gamma)


def test_the_draft_is_asked_only_for_windows_that_can_be_used(greedy_refs):
    """A window after the committed tokens can change the output only if two more tokens are wanted (the
    next one is the target's own at the pending row, whatever the window proposes): no first window for one
    token, no branches in a step that leaves fewer than two, no fallback after it, sd's last token alone."""
    target, tokenizer = load(str(TARGET_PATH))
    draft = _AskedDraft(load(str(DRAFT_PATH))[0])
    pipe = Pipeline(target, tokenizer, draft)
    try:
        for prompt, ref in greedy_refs[:3]:
            for n in (1, 2, 3, 5):
                for mode, knobs in (("mirror", dict(kappa=1, gamma=4, exit_layer=1)), ("sd", dict(gamma=4))):
                    draft.follows.clear()
                    out = pipe.generate(prompt, max_tokens=n, mode=mode, stop=False, **knobs)
                    assert_lossless(out.tokens, ref[:n])
                    assert out.stats.draft_failure is None
                    wanted = [n - (k - len(prompt)) for k in draft.follows]  # tokens still wanted after the window's context
                    assert all(w >= 2 for w in wanted), (mode, n, draft.follows)
                    assert out.stats.rollouts == len(draft.follows) and (n > 1) == (len(draft.follows) > 0), (mode, n)
    finally:
        pipe.close()


def test_target_as_its_own_draft_accepts_every_window_and_mostly_reuses(greedy_refs):
    pipes = []
    for _ in range(LANES):  # the twin in its draft host process: 128 branches a step keep it the bottleneck
        target, tokenizer = load(str(TARGET_PATH))
        pipes.append(Pipeline(target, tokenizer, load_draft(TARGET_PATH, tokenizer)))

    def check(pipe, case):
        prompt, ref = case
        out = pipe.generate(prompt, max_tokens=128, kappa=16, gamma=7, exit_layer=4, branches=128, stop=False)
        assert_lossless(out.tokens, ref)
        assert out.stats.mean_accepted == 8.0  # γ accepted + the bonus token, every forward
        assert out.stats.reuse_rate > 0.8  # a fallback only when the bonus token is outside C_γ

    try:
        in_lanes(pipes, greedy_refs[:5], check)
    finally:
        for pipe in pipes:
            pipe.close()


def test_reuse_everywhere_when_kappa_covers_the_vocabulary():
    target, draft = tiny_model("llama_tied", seed=1, vocab_size=8), tiny_model("llama_tied", seed=2, vocab_size=8)
    pipe = Pipeline(target, FakeTokenizer(8), MLXDraft(draft))
    prompt = [1, 5, 2]
    out = pipe.generate(prompt, max_tokens=40, kappa=8, gamma=3, exit_layer=2, branches=32, stop=False)
    assert_lossless(out.tokens, reference_greedy(target, prompt, 40))
    assert out.stats.fallbacks == 0 and out.stats.reuses == out.stats.steps
    pipe.close()


# --- the pieces ---------------------------------------------------------------------------------

def test_accept_is_the_longest_agreeing_prefix():
    assert accept([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accept([5, 6, 7], [4, 6, 7, 1]) == 0
    assert accept([5, 6, 7], [5, 6, 7, 1]) == 3


def test_reuse_picks_the_branch_of_the_correction_or_signals_fallback():
    cand = [[10, 11], [20, 21], [30, 31]]  # C_0, C_1, C_2 (γ = 2)
    windows = [[[1, 1], [2, 2]], [[3, 3], [4, 4]], [[5, 5], [6, 6]]]
    assert reuse_window(cand, windows, 1, 21) == [4, 4]  # A = 1, c = 21 ∈ C_1: w(1, 21)
    assert reuse_window(cand, windows, 2, 30) == [5, 5]  # full acceptance, bonus 30 ∈ C_2
    assert reuse_window(cand, windows, 0, 20) is None  # 20 ∉ C_0: fallback


def test_cache_rollback_leaves_exactly_the_committed_prefix(demo):
    prompt = demo.tokenizer.encode("Tom and Lily went to the park")
    demo.generate(prompt, max_tokens=37, stop=False, mode="mirror", kappa=8, gamma=7)
    side = demo.engine.target
    # the cache may hold accepted tokens past max_tokens (trimmed at the next start), never others
    committed = prompt + reference_greedy(demo.model, prompt, 37 + 8)
    assert len(side.cached) >= len(prompt) + 36 and side.cached == committed[: len(side.cached)]
    assert all(c.offset == len(side.cached) for c in side.cache)
    # the cached keys equal a fresh prefill of the same tokens
    fresh = copy.deepcopy(side.cache)
    for c in fresh:
        c.keys = c.values = None
        c.offset = 0
    demo.model(mx.array([side.cached]), cache=fresh)
    for a, b in zip(side.cache, fresh):
        assert mx.allclose(a.state[0][..., : a.offset, :], b.state[0][..., : b.offset, :], atol=1e-4)


def test_rollout_overlaps_the_target_suffix_in_threads():
    big_target = tiny_model("llama_tied", seed=4, vocab_size=512, hidden_size=512, intermediate_size=1536,
                            num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, head_dim=64)
    draft, tokenizer = load(str(DRAFT_PATH))
    pipe = Pipeline(big_target, tokenizer, MLXDraft(draft))
    out = pipe.generate([1, 403, 407, 261, 378], max_tokens=24, kappa=4, gamma=3, exit_layer=2, stop=False)
    overlaps = [min(s["suffix"][1], s["rollout"][1]) - max(s["suffix"][0], s["rollout"][0]) for s in out.stats.timeline]
    assert max(overlaps) > 0, "the draft's rollout never ran while the target's suffix ran"
    assert out.stats.hidden_draft_fraction > 0
    pipe.close()


@pytest.mark.parametrize("host", ["process", "thread"])
def test_the_draft_prefills_beside_the_target(request, host):
    pipe = request.getfixturevalue("demo" if host == "process" else "demo_thread")
    prompt = pipe.tokenizer.encode("Once upon a time, there was a little dog who liked to run")
    out = pipe.generate(prompt, max_tokens=2, kappa=1, gamma=5, mode="mirror", stop=False)  # one window (see below)
    assert out.stats.rollouts == 1 and out.stats.draft_forwards == 5  # no prompt forward on the decode clock
    if host == "thread":
        assert pipe.draft.cached == prompt[:-1]  # the prompt came in during prefill


def test_sd_with_an_mlx_draft_drafts_in_process_and_stays_lossless(demo, demo_thread, greedy_refs):
    """sd's serial window costs no round trip to the host: an MLX draft (a recipe, or a plain MLXDraft
    object) drafts on the target's own thread; mirror keeps its host. Greedy and seeded text unchanged."""
    seeded = dict(max_tokens=32, temperature=1.0, seed=5, stop=False)
    for pipe, host in ((demo, "process"), (demo_thread, "thread")):
        for prompt, ref in greedy_refs[:2]:
            out = pipe.generate(prompt, max_tokens=48, mode="sd", gamma=3, stop=False)
            assert_lossless(out.tokens, ref[:48])
            assert out.stats.draft_host == "in-process" and out.stats.accepted > 0
            assert_lossless(pipe.generate(prompt, mode="sd", gamma=3, **seeded).tokens,
                            pipe.generate(prompt, mode="ar", **seeded).tokens)
        assert pipe.engine.local_draft is not None and pipe.engine.local_draft is not pipe.draft
        mirror = pipe.generate(prompt, max_tokens=16, mode="mirror", kappa=2, gamma=3, stop=False)
        assert_lossless(mirror.tokens, ref[:16])
        assert mirror.stats.draft_host == host and mirror.stats.rollouts > 0


def test_a_failing_in_process_draft_switches_visibly_to_ar(greedy_refs, capsys):
    target, tokenizer = load(str(TARGET_PATH))
    draft, _ = load(str(DRAFT_PATH))
    pipe = Pipeline(target, tokenizer, MLXDraft(draft))
    prompt, ref = greedy_refs[0]
    try:
        pipe.generate(prompt, max_tokens=4, mode="sd", gamma=3)

        def exploded(*args):
            raise RuntimeError("draft exploded")

        pipe.engine.local_draft.rollout = exploded
        out = pipe.generate(prompt, max_tokens=32, mode="sd", gamma=3, stop=False)
        assert_lossless(out.tokens, ref[:32])
        assert "exploded" in out.stats.draft_failure
        assert "continuing with the target alone" in capsys.readouterr().err
    finally:
        pipe.close()


# --- failure and bad input --------------------------------------------------------------------------

class _BrokenDraft(MLXDraft):
    def __init__(self, model, fail_after: int, stall: float = 0.0):
        super().__init__(model)
        self.calls, self.fail_after, self.stall = 0, fail_after, stall

    def rollout(self, context, stems, gamma) -> Rollout:
        self.calls += 1
        if self.calls > self.fail_after:
            if self.stall:
                time.sleep(self.stall)
            else:
                raise RuntimeError("draft exploded")
        return super().rollout(context, stems, gamma)


@pytest.mark.parametrize("stall", [0.0, 3.0])
def test_failing_or_stalling_draft_switches_visibly_to_ar(greedy_refs, capsys, stall):
    target, tokenizer = load(str(TARGET_PATH))
    draft, _ = load(str(DRAFT_PATH))
    pipe = Pipeline(target, tokenizer, _BrokenDraft(draft, fail_after=3, stall=stall))
    prompt, ref = greedy_refs[0]
    out = pipe.generate(prompt, max_tokens=128, stop=False, draft_timeout=0.5 if stall else 30.0,  # 30 s: a busy box
                        mode="mirror", kappa=8, gamma=7)
    assert_lossless(out.tokens, ref)
    assert out.stats.draft_failure and ("timed out" if stall else "exploded") in out.stats.draft_failure
    assert "continuing with the target alone" in capsys.readouterr().err
    pipe.close()


class _NoPrefillDraft(MLXDraft):
    def sync(self, context, extra=()):
        raise RuntimeError("draft cannot prefill")


def test_a_draft_that_cannot_prefill_switches_visibly_to_ar(greedy_refs, capsys):
    target, tokenizer = load(str(TARGET_PATH))
    draft, _ = load(str(DRAFT_PATH))
    pipe = Pipeline(target, tokenizer, _NoPrefillDraft(draft))
    prompt, ref = greedy_refs[0]
    out = pipe.generate(prompt, max_tokens=32, stop=False, mode="mirror", kappa=8, gamma=7)
    assert_lossless(out.tokens, ref[:32])
    assert out.stats.mode == "ar" and "cannot prefill" in out.stats.draft_failure
    assert "continuing with the target alone" in capsys.readouterr().err
    pipe.close()


@pytest.mark.parametrize("kwargs,message", [
    (dict(kappa=0), "kappa must be at least 1"),
    (dict(gamma=0), "gamma must be at least 1"),
    (dict(exit_layer=5), r"exit layer 5 is outside 1\.\.4"),
    (dict(exit_layer=0), r"exit layer 0 is outside 1\.\.4"),
    (dict(max_tokens=600), "exceeds the target's context of 512"),
    (dict(mode="fast"), "unknown mode"),
    (dict(mode="mirror", kappa=2, gamma=3, branches=0), r"branches must be at least 1 \(got 0\): a step has "
                                                         r"kappa\*\(gamma\+1\) = 2\*\(3\+1\) = 8 to choose from"),
])
def test_bad_options_are_refused_with_one_sentence(demo, kwargs, message):
    with pytest.raises(ValueError, match=message):
        demo.generate("Once upon a time", **kwargs)


def test_mirror_without_draft_is_refused():
    target, tokenizer = load(str(TARGET_PATH))
    pipe = Pipeline(target, tokenizer, None)
    with pytest.raises(ValueError, match="needs a draft model"):
        pipe.generate("Once upon a time", mode="mirror")
    ar = pipe.generate("Once upon a time", mode="ar", max_tokens=5)
    assert len(ar.tokens) == 5 and ar.stats.target_forwards == 5
    assert 0 < ar.stats.suffix_seconds <= ar.stats.decode_seconds  # ar's forwards are timed too
    pipe.close()


