"""mode="auto" and `mirror-mlx tune`: the cost model, profiles, and auto staying lossless and overridable."""

import json
import os
from dataclasses import replace

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx_lm import load as mlx_load

from mirror_mlx.tune import calibrate, cost_model, policy, report, timing, traces
from mirror_mlx.tune import profile as profiles
from mirror_mlx.cli import main
from mirror_mlx.tune.cost_model import Acceptance, Config, Timings, Trace, describe, grid, predict, rank, replay
from mirror_mlx.demo import EXIT_ADAPTER as DEMO_EXIT_ADAPTER
from mirror_mlx.pipeline import Pipeline, load
from tests.models import DRAFT_PATH, TARGET_PATH, tiny_model
from tests.support import assert_lossless, profile_row, reference_greedy

PROMPT = "Once upon a time"


@pytest.fixture(scope="module", autouse=True)
def own_cache(tmp_path_factory):
    """These tests are about calibration: an empty tuning cache of their own, so the first auto call calibrates
    for real (the session's cache holds the demo pairs' pinned profiles, conftest.py)."""
    old = os.environ["MIRROR_MLX_CACHE"]
    os.environ["MIRROR_MLX_CACHE"] = str(tmp_path_factory.mktemp("tune-cache"))
    yield
    os.environ["MIRROR_MLX_CACHE"] = old


@pytest.fixture(scope="module")
def pipe(own_cache, pipe):
    """conftest's demo pair, loaded once this module's own tuning cache is in place."""
    return pipe


# --- the cost model -------------------------------------------------------------------------------


def test_replay_counts_accepted_tokens_and_reuse_along_a_trace():
    # runs: the draft's window at 0 matches 2 tokens, at 3 none, at 4 three.
    tr = Trace(runs=[2, 1, 0, 0, 3, 2, 1, 0], rank_excl={2: [9, 9, 0, 5, 9, 9, 9, 1]},
               rank_plain={2: [9, 9, 9, 9, 9, 9, 9, 0]})
    # γ=3: step at 0 accepts 2, corrects at 2 (rank 0); step at 3 accepts 0, corrects at 3 (rank 5);
    # step at 4 accepts 3 (full window), bonus at 7 (plain rank 0).
    assert replay(tr, gamma=3, kappa=1, exit_layer=2) == (3, 8, 2)
    assert replay(tr, gamma=3, kappa=6, exit_layer=2) == (3, 8, 3)
    # γ=1: steps at 0 (2 tokens), 2, 3 (1 each), 4 and 6 (2 each)
    assert replay(tr, gamma=1)[:2] == (5, 8)
    # a window that runs past the end of the text: the last step commits what is left
    assert replay(Trace(runs=[3, 2, 1]), gamma=5)[:2] == (1, 3)


def synthetic(window_ms: float, rank: int) -> tuple[Timings, Acceptance]:
    """A target whose forward costs 10 ms (+1 ms a row), a draft window of `window_ms` ms, a draft that
    always matches 2 tokens, and an early exit that ranks every correction at `rank`."""
    gammas, kappas, layers = (1, 2, 3), (1, 4), (1, 2)
    t = Timings(overhead={"ar": 0.5e-3, "sd": 1e-3, "mirror": 1.5e-3})
    for n in (1, 2, 3, 4):
        t.verify[n] = 1e-3 * (10 + n)
    for g in gammas:
        t.window[g] = 1e-3 * window_ms * g
        for e in layers:
            t.prefix[(e, g + 1)] = 1e-3 * (10 + g + 1) * e / 4
            t.suffix[(e, g + 1)] = 1e-3 * (10 + g + 1) * (4 - e) / 4
            for k in kappas:
                t.parallel[(e, k, g)] = max(t.suffix[(e, g + 1)], 1e-3 * window_ms * g * (1 + k / 4))
    runs = [2, 1, 0] * 20
    trace = Trace(runs=runs, rank_excl={e: [rank] * len(runs) for e in layers},
                  rank_plain={e: [rank] * len(runs) for e in layers})
    return t, Acceptance([trace])


def test_the_ranking_is_the_arg_max_of_the_predictions():
    t, acc = synthetic(window_ms=1.0, rank=0)
    configs = grid((1, 4), (1, 2, 3), (1, 2))
    ranked = rank(configs, t, acc)
    best = max(configs, key=lambda c: predict(c, t, acc)["tokens_per_second"])
    assert ranked[0]["config"] == best
    assert [r["tokens_per_second"] for r in ranked] == sorted((r["tokens_per_second"] for r in ranked), reverse=True)
    # cheap draft, every correction rolled out: Mirror-SD hides the draft and wins
    assert best.mode == "mirror" and ranked[0]["reuse"] == 1.0


def test_a_branch_budget_predicts_the_top_b_branches_mass_and_a_rollout_of_b_rows():
    """B of the κ(γ+1) branches: the reuse predicted is the traces' mass of the B (row, rank) cells that held the
    most corrections; T_par is the floor at B rows (read between the measured row counts) with the contention
    measured at κ(γ+1)."""
    tr = Trace(runs=[2, 1, 0, 0, 3, 2, 1, 0], rank_excl={2: [9, 9, 0, 5, 9, 9, 9, 1]},
               rank_plain={2: [9, 9, 9, 9, 9, 9, 9, 0]})
    acc = Acceptance([tr])  # γ=3, κ=6: steps end at (row 2, rank 0), (row 0, rank 5), (row 3, rank 0)
    assert acc.reuse_rate(6, 3, 2) == acc.reuse_rate(6, 3, 2, branches=24) == 1.0
    assert acc.reuse_rate(6, 3, 2, branches=2) == pytest.approx(2 / 3)
    assert acc.reuse_rate(1, 3, 2, branches=1) == pytest.approx(1 / 3)  # the κ=1 cells: (2, 0) and (3, 0), one each
    t, acc = synthetic(window_ms=1.0, rank=0)
    t.rollout = {(4, 1): 2e-3, (8, 1): 6e-3}
    full, budget = Config("mirror", 4, 1, 1), Config("mirror", 4, 1, 1, branches=6)
    assert budget.rows == 6 and budget.name == "mirror κ=4 γ=1 ℓe=1 B=6"
    suffix = t.suffix[(1, 2)]
    from mirror_mlx.tune.cost_model import parallel_time, rollout_time
    assert rollout_time(t, 6, 1) == pytest.approx(4e-3) and rollout_time(t, 1, 1) == t.window[1]
    assert parallel_time(full, t) == t.parallel[(1, 4, 1)]
    assert parallel_time(budget, t) == pytest.approx(max(suffix, 4e-3) * t.parallel[(1, 4, 1)] / max(suffix, 6e-3))
    configs = grid((1, 4), (1, 3), (1,), branches=(None, 2, 4))
    assert Config("mirror", 4, 1, 1, branches=4) in configs  # κ(γ+1) = 8 > 4
    assert Config("mirror", 1, 3, 1, branches=4) not in configs and Config("mirror", 1, 3, 1, branches=2) in configs
    # None at each (κ, γ), and the B below κ(γ+1): (1, 1) none, (1, 3) 2, (4, 1) and (4, 3) 2 and 4
    assert sum(c.mode == "mirror" for c in configs) == 4 + 1 + 2 + 2


def test_a_profile_with_a_branch_budget_round_trips_and_auto_runs_it(pipe, tmp_path, monkeypatch):
    """A chosen B is saved, loaded back and run by auto (and by an explicit mode from its row); a file from
    before budgets (no "branches") loads as every branch."""
    monkeypatch.setenv("MIRROR_MLX_CACHE", str(tmp_path))
    key = profiles.key_for(tiny_model("llama_tied", seed=0))
    table = [profile_row("ar", None, 1.0, 10.0),
             dict(profile_row("mirror", 3, 2.3, 5.0, kappa=2, exit_layer=2), branches=4)]
    saved = profiles.Profile(key=key, mode="mirror", kappa=2, gamma=3, exit_layer=2, branches=4, why="tuned",
                             table=table)
    assert profiles.saved(key) is None and profiles.saved(profiles.save(saved) and key) == saved
    data = json.loads(profiles.path_for(key).read_text())
    del data["branches"]
    profiles.path_for(key).write_text(json.dumps(data))
    assert profiles.saved(key).branches is None
    c = policy.knobs_from(saved, None, "mirror", None, None, None)
    assert (c.kappa, c.gamma, c.branches) == (2, 3, 4) and "branches=4" in c.why
    fresh = Pipeline(pipe.model, pipe.tokenizer, pipe.draft)
    try:
        fresh.auto.profile = profiles.Profile(**{**saved.__dict__, "key": profiles.pipe_key(fresh)})
        ref = pipe.generate(PROMPT, max_tokens=24, mode="ar", stop=False).tokens
        out = fresh.generate(PROMPT, max_tokens=24, stop=False)
        assert_lossless(out.tokens, ref)
        assert (out.stats.mode, out.stats.kappa, out.stats.branches) == ("mirror", 2, 4)
        assert out.stats.branches_rolled <= 4 * out.stats.steps
        assert fresh.generate(PROMPT, max_tokens=8, branches=3, stop=False).stats.branches == 3  # asked: wins
        bad = dict(saved.__dict__, branches=0)
        profiles.path_for(key).write_text(json.dumps(bad))
        with pytest.raises(profiles.ProfileError, match="branches: 0"):
            profiles.saved(key)
    finally:
        fresh.close()


def test_a_fallback_heavy_regime_picks_sd_or_ar():
    # the early exit never holds the correction (rank 50 > κ): every mirror step pays the fallback window
    t, acc = synthetic(window_ms=4.0, rank=50)
    ranked = rank(grid((1, 4), (1, 2, 3), (1, 2)), t, acc)
    assert ranked[0]["config"].mode in ("sd", "ar")
    assert all(r["reuse"] == 0.0 for r in ranked)
    # and an expensive draft makes plain generation the best
    t, acc = synthetic(window_ms=40.0, rank=50)
    assert rank(grid((1, 4), (1, 2, 3), (1, 2)), t, acc)[0]["config"] == Config("ar")


def test_the_trace_of_a_plain_draft_equals_the_one_its_rollouts_give(pipe):
    """The teacher-forced shortcut for a plain MLX draft must agree with real rollouts at every position."""
    prompts = traces.calibration_prompts(pipe, 3)
    assert len({len(p) for p in prompts}) == 1  # the built-in openings are cut to one length: one batch
    texts = traces.greedy_texts(pipe, prompts, 24)
    prompt = prompts[0]
    assert texts[0] == traces.greedy_texts(pipe, [prompt], 24)[0]  # batched = alone
    assert traces.plain_draft_model(pipe) is not None  # load(): a copy of the host's plain draft, loaded here
    slow, text = traces.trace(pipe, prompt, 24, [2], 5, draft_model=None)  # a host rollout per position
    fast, _ = traces.trace(pipe, prompt, 24, [2], 5, text=texts[0])
    assert fast == slow and len(fast.runs) == len(text) - len(prompt)
    assert any(r > 0 for r in fast.runs) and any(r == 0 for r in fast.runs)


def test_a_prepare_longer_than_the_prefix_delays_the_rollout_by_the_difference():
    """The draft feeds the window during the prefix (mirror's prepare); the branch rollout starts when both
    are done, so T_par's floor is max(suffix, max(0, prepare - prefix) + rollout)."""
    from mirror_mlx.tune.cost_model import parallel_time

    t, _ = synthetic(window_ms=1.0, rank=0)
    t.rollout, t.parallel = {(8, 1): 6e-3}, {}  # (suffix ‖ rollout not measured: the floor)
    cfg = Config("mirror", 4, 1, 1)
    prefix, suffix = t.prefix[(1, 2)], t.suffix[(1, 2)]
    t.prepare = {1: prefix / 2}  # hidden in the prefix
    assert parallel_time(cfg, t) == pytest.approx(max(suffix, 6e-3))
    t.prepare = {1: prefix + 0.05}  # 50 ms past the prefix: the rollout starts that much later
    assert parallel_time(cfg, t) == pytest.approx(0.05 + 6e-3)


def test_a_point_without_a_budget_is_predicted_with_the_branches_that_end_within_its_suffix():
    """As the engine fits its branches (branch_budget.RolloutCost), the model rolls out the most rows whose
    rollout still ends within the suffix: here 1 row 1 ms, 8 rows 8 ms (1 ms a row), a 5.5 ms suffix: 5."""
    from mirror_mlx.tune.cost_model import fitted

    t, _ = synthetic(window_ms=1.0, rank=0)
    t.rollout = {(8, 1): 8e-3}
    t.suffix[(1, 2)] = 5.5e-3
    assert fitted(Config("mirror", 4, 1, 1), t) == Config("mirror", 4, 1, 1, branches=5)
    assert fitted(Config("mirror", 4, 1, 1, branches=7), t).branches == 7  # a B given stays
    t.suffix[(1, 2)] = 9e-3
    assert fitted(Config("mirror", 4, 1, 1), t).branches is None  # every branch hides


def test_tune_measures_suffix_with_rollout_only_where_the_top_can_change():
    """Unmeasured points are predicted at their floor, max(suffix, rollout alone): an upper bound. Measuring
    the bounded points of the top until none is left gives the top that measuring every point gives."""
    import threading

    full, acc = synthetic(window_ms=3.0, rank=0)
    for (e, k, g), v in full.parallel.items():  # contention: together costs more than the floor
        full.rollout[(k * (g + 1), g)] = 1e-3 * 3.0 * g * (1 + k / 4) * 0.8
        full.parallel[(e, k, g)] = v * (1.1 + 0.05 * k)
    configs = grid((1, 4), (1, 2, 3), (1, 2))
    lazy = Timings(**{f: dict(getattr(full, f)) for f in ("verify", "prefix", "suffix", "window", "rollout", "overhead")})
    asked = []

    class Bench:
        def parallel(self, e, k, g):
            asked.append((e, k, g))
            return full.parallel[(e, k, g)]

    class Pipe:
        lock = threading.Lock()

    assert all(predict(c, lazy, acc)["tokens_per_second"] >= predict(c, full, acc)["tokens_per_second"] for c in configs)
    n = timing.measure_parallel(Pipe(), Bench(), lazy, configs, acc, top=4, reps=1, tick=lambda: None)
    assert n == len(set(asked)) < len(full.parallel)
    assert [r["config"] for r in rank(configs, lazy, acc)[:4]] == [r["config"] for r in rank(configs, full, acc)[:4]]
    assert not any(r["bound"] for r in rank(configs, lazy, acc)[:4])


def test_suffix_with_rollout_timed_in_later_rounds_is_put_on_the_first_rounds_scale(monkeypatch):
    """The machine slows down 2x from one round of measure_parallel to the next: each later round times the
    first point measured again beside its new ones and scales them by it, so all points stay comparable."""
    import threading

    full, acc = synthetic(window_ms=3.0, rank=0)
    for (e, k, g), v in full.parallel.items():
        full.rollout[(k * (g + 1), g)] = 0.8 * v
    configs = grid((1, 4), (1, 2, 3), (1, 2))
    lazy = Timings(**{f: dict(getattr(full, f)) for f in ("verify", "prefix", "suffix", "window", "rollout", "overhead")})
    slow, timed = [1.0], timing.interleaved

    def slowing(pieces, *args):
        out = timed(pieces, *args)
        slow[0] *= 2
        return out

    class Bench:
        def parallel(self, e, k, g):
            return full.parallel[(e, k, g)] * slow[0]

    class Pipe:
        lock = threading.Lock()

    monkeypatch.setattr(timing, "interleaved", slowing)
    timing.measure_parallel(Pipe(), Bench(), lazy, configs[-2:], acc, top=2, reps=1, tick=lambda: None)  # round 1
    timing.measure_parallel(Pipe(), Bench(), lazy, configs, acc, top=6, reps=1, tick=lambda: None)
    assert slow[0] >= 4 and len(lazy.parallel) > 2  # two rounds or more, at 1x, 2x, ...
    assert lazy.parallel == pytest.approx({k: full.parallel[k] for k in lazy.parallel})


def test_overhead_probed_at_two_windows_is_read_between_them():
    from mirror_mlx.tune.cost_model import overhead

    t = Timings(overhead={"ar": 1e-3, "sd": {1: 2e-3, 3: 6e-3}})
    assert overhead(Config("ar"), t) == 1e-3
    assert [overhead(Config("sd", gamma=g), t) for g in (1, 2, 3, 7)] == pytest.approx([2e-3, 4e-3, 6e-3, 6e-3])
    assert overhead(Config("mirror", 1, 2, 1), t) == 0.0  # not probed: none


def test_component_timings_are_taken_in_rounds():
    """One call of each piece per round (a burst of load hits all alike); each piece's median."""
    calls = []
    pieces = {k: (lambda k=k: calls.append(k) or {"a": 0.1, "b": 0.2}[k]) for k in ("a", "b")}
    assert timing.interleaved(pieces, reps=3) == {"a": 0.1, "b": 0.2}
    assert calls == ["a", "b"] * 3
    halves = timing.interleaved({"x": lambda: (0.1, 0.3)}, reps=3)
    assert halves == {"x": (0.1, 0.3)}


# --- profiles -------------------------------------------------------------------------------------


def test_a_profile_is_keyed_by_the_weights_of_target_draft_and_adapter():
    a, b = tiny_model("llama_tied", seed=0), tiny_model("llama_tied", seed=1)
    assert profiles.fingerprint(a) == profiles.fingerprint(tiny_model("llama_tied", seed=0))
    assert profiles.fingerprint(a) != profiles.fingerprint(b)  # same config, other weights
    key = profiles.key_for(a, b)
    assert profiles.key_for(b, a) != key and profiles.key_for(a, a) != key
    target, _ = mlx_load(str(TARGET_PATH))
    from mirror_mlx.engine.exit_adapter import load_adapter

    adapter = load_adapter(DEMO_EXIT_ADAPTER, target)
    assert profiles.key_for(target, b, adapter) != profiles.key_for(target, b)


def test_a_saved_profile_loads_back_and_is_not_reused_for_another_pair(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRROR_MLX_CACHE", str(tmp_path))
    a, b = tiny_model("llama_tied", seed=0), tiny_model("qwen2", seed=0)
    key = profiles.key_for(a, b)
    saved = profiles.Profile(key=key, mode="mirror", kappa=2, gamma=3, exit_layer=1, why="test")
    path = profiles.save(saved)
    assert path.parent == tmp_path
    assert profiles.saved(key) == saved
    assert profiles.saved(profiles.key_for(b, a)) is None
    assert profiles.saved(profiles.key_for(a, b, adapter=tiny_model("llama_tied", seed=2))) is None


def test_a_corrupt_profile_says_so_and_is_recalibrated(pipe, capfd):
    key = profiles.pipe_key(pipe)
    path = profiles.path_for(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"key": {"target": ')
    with pytest.raises(profiles.ProfileError, match="corrupt.*delete it or run `mirror-mlx tune`"):
        profiles.saved(key)
    fresh = Pipeline(pipe.model, pipe.tokenizer, pipe.draft, pipe.engine.exit_adapter)  # no profile in memory
    try:
        result = fresh.generate(PROMPT, max_tokens=12)
    finally:
        fresh.close()
    err = capfd.readouterr().err
    assert "is corrupt" in err and "recalibrating" in err and "quick calibration" in err
    assert describe(profiles.saved(key)) == describe(result.stats)  # rewritten, readable


def test_a_calibration_at_a_temperature_traces_the_targets_own_samples_and_runs_every_mode_at_it(pipe, capfd,
                                                                                                monkeypatch):
    """The temperature the user samples at (`tune --temperature`, or a first auto call's): the traces follow the
    target's own seeded samples there (a draft's token is accepted only where it equals the target's draw), every
    real run samples at it, and the profile says so. Its text differs from the greedy one, so its acceptance
    does too."""
    fresh = Pipeline(pipe.model, pipe.tokenizer, pipe.draft, pipe.engine.exit_adapter)
    asked = []
    run = fresh.generate
    fresh.generate = lambda *a, **kw: asked.append(kw.get("temperature", 0.0)) or run(*a, **kw)
    try:
        prompts = traces.calibration_prompts(fresh, 2)
        sampled = calibrate.sampled_texts(fresh, prompts, 16, 1.0)
        assert sampled == [run(p, mode="ar", max_tokens=16, temperature=1.0, seed=calibrate.SAMPLE_SEED).tokens
                           for p in prompts]
        assert sampled != traces.greedy_texts(fresh, prompts, 16)
        asked.clear()
        cfg = calibrate.TuneConfig.quick(1.0)
        cfg.budget_s = None
        hot = calibrate.calibrate(fresh, cfg)
        assert hot.calibration["temperature"] == 1.0 and set(asked) == {1.0}  # traces and every real run
        greedy = policy.profile_for(pipe)  # the same quick calibration at temperature 0
        assert greedy.calibration["temperature"] == 0.0
        assert hot.calibration["acceptance"] != greedy.calibration["acceptance"]
    finally:
        fresh.close()
    # a first auto call that samples calibrates at its temperature (the calibration above), and says so
    first = Pipeline(pipe.model, pipe.tokenizer, pipe.draft, pipe.engine.exit_adapter)
    path = profiles.path_for(profiles.pipe_key(first))
    kept = path.read_bytes()
    path.unlink()
    configs = []
    monkeypatch.setattr(calibrate, "calibrate", lambda p, cfg, key: configs.append(cfg) or replace(hot, key=key))
    try:
        capfd.readouterr()
        first.generate(PROMPT, max_tokens=8, temperature=1.0, seed=1)
        assert "quick calibration at temperature 1 " in capfd.readouterr().err
        assert [c.temperature for c in configs] == [1.0] and configs[0].budget_s is not None  # the quick one
    finally:
        first.close()
        path.write_bytes(kept)


# --- mode="auto" ----------------------------------------------------------------------------------


def test_auto_is_lossless_and_says_what_it_chose(pipe):
    model, tokenizer = mlx_load(str(TARGET_PATH))
    expected, _ = policy.choice(pipe.profile, pipe.auto, pipe.facts(), None, None, None, sampling=(0.0, None))  # the profile's, or adapted to what was seen
    result = pipe.generate(PROMPT, max_tokens=40)
    assert_lossless(result.tokens, reference_greedy(model, tokenizer.encode(PROMPT), 40))
    s = result.stats
    assert (describe(s), s.why) == (describe(expected), expected.why) and s.why.startswith("auto: ")
    if s.chosen_mode == "mirror":
        assert (s.kappa, s.gamma, s.exit_layer) == (expected.kappa, expected.gamma, expected.exit_layer)
    assert f"mode {s.mode}" in s.summary() and "auto: " in s.summary()


def test_the_choice_is_the_fastest_confirmed_configuration_by_its_measured_step_time(pipe):
    """Among the confirmed ones (the top predictions, at most half of one γ, ar and the recycled tree with the
    lookup, each measured on the same prompts): the traces' tokens per step over the measured seconds per step
    (the tree's: its own run's)."""
    prof = policy.profile_for(pipe)
    measured = [r for r in prof.table if r["confirmed"]]
    assert all(r["measured"] is not None and r["measured_step_ms"] > 0 for r in measured)
    ar = next(r for r in measured if r["mode"] == "ar")  # never chosen without measuring plain generation
    rate = lambda r: r["tokens_per_step"] / r["measured_step_ms"]  # noqa: E731
    best = max(measured, key=rate)
    if rate(best) < cost_model.AR_MARGIN * rate(ar):  # a gain within noise is not taken
        best = ar
    assert (prof.mode, prof.kappa, prof.gamma, prof.exit_layer) == tuple(best[k] for k in
                                                                        ("mode", "kappa", "gamma", "exit_layer"))
    quick = calibrate.TuneConfig.quick()
    assert len(prof.table) == len(grid(quick.kappas, quick.gammas, [2], branches=quick.branches)) + 1  # ℓe = 2
    assert [r["mode"] for r in measured].count("recycle") == 1  # measured, never predicted


def best_row(prof, mode, **given):
    """A mode's best row as auto ranks rows: every measured one (confirmed or probe) by its expected rate,
    else the best prediction."""
    rows = [r for r in prof.table if r["mode"] == mode and all(r[k] == v for k, v in given.items())]
    measured = [r for r in rows if r.get("measured_step_ms")]
    if measured:
        return max(measured, key=cost_model.expected_rate)
    return max(rows, key=lambda r: r["predicted"])


def test_an_explicit_mode_runs_its_fastest_measured_point_even_where_that_is_a_probe():
    """Confirming measures the top predictions; a wide κ predicted first can measure far below a probe that
    was measured on the way (as `tune` found on the bench's pair: κ=8 γ=3 confirmed at 6.4 tok/s, a κ=1 γ=3
    probe at 10.3): the mode runs the probe. A prediction never outranks a measurement."""
    row = dict(mode="mirror", exit_layer=5, placement="unpinned", reuse=0.6, tokens_per_step=2.36, step_ms=130.0)
    table = [dict(row, kappa=8, gamma=3, predicted=18.0, measured=6.4, measured_step_ms=272.0, confirmed=True),
             dict(row, kappa=1, gamma=3, predicted=15.9, measured=10.3, measured_step_ms=149.9, confirmed=False,
                  probe=True),
             dict(row, kappa=2, gamma=3, predicted=30.0, measured=None, measured_step_ms=None, confirmed=False),
             dict(row, kappa=1, gamma=5, predicted=17.0, measured=None, measured_step_ms=None, confirmed=False)]
    prof = profiles.Profile(key={}, mode="ar", why="tuned", table=table)
    c = policy.knobs_from(prof, None, "mirror", None, None, None)
    assert (c.kappa, c.gamma, c.exit_layer) == (1, 3, 5)
    assert c.why == "mode mirror as asked; kappa=1 gamma=3 exit_layer=5 from the tuned profile"
    c = policy.knobs_from(prof, None, "mirror", None, 5, None)  # no measured γ=5 row: its best prediction
    assert (c.kappa, c.gamma) == (1, 5)


def test_an_explicit_mode_without_knobs_runs_the_profiles_best_row_for_it_and_is_lossless(pipe):
    model, tokenizer = mlx_load(str(TARGET_PATH))
    ref = reference_greedy(model, tokenizer.encode(PROMPT), 24)
    prof = policy.profile_for(pipe)
    for mode, names in (("mirror", ("kappa", "gamma", "exit_layer")), ("sd", ("gamma",))):
        out = pipe.generate(PROMPT, max_tokens=24, mode=mode, stop=False)
        s, best = out.stats, best_row(prof, mode)
        names += ("branches",) if best.get("branches") is not None else ()  # a row's B comes with its κ and γ
        assert_lossless(out.tokens, ref)
        assert s.mode == s.chosen_mode == mode and s.proposed > 0
        assert tuple(getattr(s, k) for k in names) == tuple(best[k] for k in names)
        picked = " ".join(f"{k}={best[k]}" for k in names)
        assert s.why == f"mode {mode} as asked; {picked} from the profile (quick calibration)"


def test_explicit_knobs_win_over_the_profile_and_fill_the_rest_from_it(pipe):
    prof = policy.profile_for(pipe)
    s = pipe.generate(PROMPT, max_tokens=8, mode="mirror", kappa=8, gamma=7).stats
    assert (s.mode, s.kappa, s.gamma, s.why) == ("mirror", 8, 7, "mode mirror as asked")
    s = pipe.generate(PROMPT, max_tokens=8, mode="mirror", gamma=2).stats  # κ and ℓe from the best γ=2 row
    best = best_row(prof, "mirror", gamma=2)
    assert (s.kappa, s.gamma, s.exit_layer, s.branches) == (best["kappa"], 2, best["exit_layer"], best.get("branches"))
    budget = f" branches={best['branches']}" if best.get("branches") is not None else ""  # the row's B, if any
    assert s.why == f"mode mirror as asked; kappa={best['kappa']} exit_layer={best['exit_layer']}{budget} from the " \
                    "profile (quick calibration)"
    assert pipe.generate(PROMPT, max_tokens=8, mode="sd", gamma=5).stats.why == "mode sd as asked"
    s = pipe.generate(PROMPT, max_tokens=8, kappa=2).stats  # κ only means mirror; γ from the profile's grid
    assert (s.chosen_mode, s.kappa) == ("mirror", 2) and "kappa=2" in s.why


def test_an_explicit_mode_without_a_calibrated_row_runs_small_knobs_and_says_uncalibrated(pipe):
    model, tokenizer = mlx_load(str(TARGET_PATH))
    fresh = Pipeline(pipe.model, pipe.tokenizer, pipe.draft, pipe.engine.exit_adapter)
    why = "quick calibration ran out of its 20 s budget (MIRROR_MLX_QUICK_BUDGET), so ar, the safe rule"
    fresh.auto.profile = profiles.Profile(key=profiles.pipe_key(fresh), mode="ar", why=why)
    try:
        out = fresh.generate(PROMPT, max_tokens=24, mode="mirror", stop=False)
        s = out.stats
        assert (s.kappa, s.gamma, s.exit_layer) == (1, 3, 2)  # ℓe: the demo's exit adapter's layer
        assert "uncalibrated" in s.why and why in s.why
        assert_lossless(out.tokens, reference_greedy(model, tokenizer.encode(PROMPT), 24))
        assert fresh.generate(PROMPT, max_tokens=8, mode="sd").stats.gamma == 3
    finally:
        fresh.close()


def test_a_quick_calibration_out_of_budget_is_ar_under_auto_and_small_uncalibrated_knobs_when_asked(
        pipe, tmp_path, monkeypatch, capfd):
    """Never below the target alone: auto runs ar (mlx-lm's own loop's text, at its cost); an explicit mode
    runs small knobs and says why."""
    monkeypatch.setenv("MIRROR_MLX_CACHE", str(tmp_path))
    monkeypatch.setenv("MIRROR_MLX_QUICK_BUDGET", "0.001")
    model, tokenizer = mlx_load(str(TARGET_PATH))
    ref = reference_greedy(model, tokenizer.encode(PROMPT), 16)
    fresh = Pipeline(pipe.model, pipe.tokenizer, pipe.draft, pipe.engine.exit_adapter)
    try:
        auto = fresh.generate(PROMPT, max_tokens=16, stop=False)
        assert_lossless(auto.tokens, ref)
        assert auto.stats.mode == "ar" and "ran out of its 0.001 s budget" in auto.stats.why
        assert "not saved" in capfd.readouterr().err and not list(tmp_path.iterdir())
        asked = fresh.generate(PROMPT, max_tokens=16, mode="mirror", stop=False).stats
        assert (asked.mode, asked.kappa, asked.gamma) == ("mirror", 1, 3) and "uncalibrated" in asked.why
    finally:
        fresh.close()


def test_sd_is_calibrated_as_it_runs_drafting_in_process(pipe):
    """auto's sd candidate is the in-process one: its window is timed on the target's thread, and its
    confirmed runs are real sd generations, which draft there."""
    prof = policy.profile_for(pipe)
    timings = prof.calibration["timings"]
    assert set(timings["local_window"]) == set(timings["window"]) and all(v > 0 for v in timings["local_window"].values())
    assert pipe.generate(PROMPT, max_tokens=8, mode="sd", gamma=2).stats.draft_host == "in-process"


def test_cli_mode_flag_wins_and_auto_is_the_default():
    def run(*a):  # the --json line (the first auto call of a process also says its quick calibration on stderr)
        out = CliRunner().invoke(main, ["generate", "--max-tokens", "12", "--json", *a]).output
        return json.loads(next(line for line in out.splitlines() if line.startswith("{")))

    explicit = run("--mode", "sd", "--gamma", "2")["stats"]
    assert (explicit["chosen_mode"], explicit["mode"], explicit["why"]) == ("sd", "sd", "mode sd as asked")
    picked = run("--mode", "sd")["stats"]  # no γ: the profile's
    assert picked["chosen_mode"] == "sd" and picked["why"].startswith("mode sd as asked; gamma=")
    auto = run()["stats"]
    assert auto["why"].startswith("auto: ") and auto["chosen_mode"] in ("mirror", "sd", "ar")


def test_auto_without_a_draft_is_plain_generation():
    p = load(str(TARGET_PATH))
    try:
        s = p.generate(PROMPT, max_tokens=4).stats
    finally:
        p.close()
    assert (s.chosen_mode, s.why) == ("ar", "auto: no draft model, so ar")


def test_tune_command_prints_predicted_against_measured_and_saves_the_profile():
    args = ["tune", "--quick", "--model", str(TARGET_PATH), "--draft-model", str(DRAFT_PATH)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "predicted" in result.output and "measured" in result.output and "(probe)" in result.output
    assert "Core ML compute plan: skipped (the draft is not a Core ML package)" in result.output
    assert "chose " in result.output and "wrote " in result.output
    assert "draft acceptance α per γ on the calibration text" in result.output and "γ=3 0." in result.output
    p = load(str(TARGET_PATH), str(DRAFT_PATH))
    try:
        assert profiles.saved(profiles.pipe_key(p)) is not None  # the next auto run uses it
    finally:
        p.close()


def test_tune_quick_refuses_the_flags_it_would_ignore():
    args = ["tune", "--quick", "--limit", "2", "--min-seconds", "1", "--model", str(TARGET_PATH)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2
    assert "--quick measures its own small set, so --limit, --min-seconds would be ignored" in r.output


def test_the_core_ml_compute_plan_says_why_it_is_skipped():
    import sys

    from mirror_mlx.tune.compute_plan import report, unavailable_reason

    assert report(None) == "Core ML compute plan: skipped (the draft is not a Core ML package)"
    if sys.platform != "darwin":
        assert "needs macOS 14.4+" in unavailable_reason("draft.mlpackage")


def test_auto_with_a_failing_draft_says_so_and_runs_plain(capfd):
    class Exploding:  # fails on its first rollout, as a broken draft host would
        vocab_size = 512

        def reset(self):
            pass

        def rollout(self, context, stems, gamma):
            raise RuntimeError("draft exploded")

    target, tokenizer = mlx_load(str(TARGET_PATH))
    p = Pipeline(target, tokenizer, Exploding())
    try:
        out = p.generate(PROMPT, max_tokens=8)
    finally:
        p.close()
    assert_lossless(out.tokens, reference_greedy(target, tokenizer.encode(PROMPT), 8))
    assert out.stats.chosen_mode == "ar" and "quick calibration failed" in out.stats.why
    assert "draft exploded" in capfd.readouterr().err


def test_tune_calibrates_with_one_exit_adapter_per_layer(pipe, tmp_path, monkeypatch):
    """`--exit-adapter a,b`: the candidates are the usual exit layers the adapters cover, each with its own."""
    from mirror_mlx.engine.exit_adapter import ExitAdapter, adapter_meta, load_adapters, save_adapter

    monkeypatch.setenv("MIRROR_MLX_CACHE", str(tmp_path))
    first = tmp_path / "exit1.safetensors"  # the identity adapter (the bare head) at layer 1, beside the demo's at 2
    save_adapter(first, ExitAdapter(pipe.model.args.hidden_size, 8), adapter_meta(pipe.model, 1))
    both = load_adapters(f"{first},{DEMO_EXIT_ADAPTER}", pipe.model)
    two = Pipeline(pipe.model, pipe.tokenizer, pipe.draft, both)
    try:
        cfg = calibrate.TuneConfig(prompts=1, max_tokens=8, kappas=(1,), gammas=(2,), reps=1, confirm=1, min_seconds=0,
                              progress=False)
        assert calibrate.exit_layer_candidates(two, cfg) == [1, 2]  # N = 5: N/4 = N/3 = 1, N/2 = 2; 3N/4 = 3 has none
        assert calibrate.exit_layer_candidates(two, calibrate.TuneConfig.quick()) == [1, 2]  # N/2 and each adapter's layer
        assert calibrate.exit_layer_candidates(pipe, calibrate.TuneConfig.quick()) == [2]  # one adapter, at N/2
        prof = calibrate.calibrate(two, cfg)
        assert {r["exit_layer"] for r in prof.table if r["mode"] == "mirror"} == {1, 2}
        out = two.generate(PROMPT, max_tokens=12, mode="mirror", kappa=2, gamma=2, exit_layer=1)
        assert_lossless(out.tokens, two.generate(PROMPT, max_tokens=12, mode="ar").tokens)
    finally:
        two.close()


def test_a_probes_overhead_is_fitted_so_its_prediction_is_its_measured_step():
    """fit_overheads: a probe's overhead is its run's step time minus the modelled components, so the
    prediction for that probe is the step it measured (no reuse term for ar and sd); a step shorter than
    half the components (components timed alone on a busy moment) is predicted at that half instead."""
    t = Timings(verify={1: 0.010, 2: 0.013, 4: 0.016}, window={1: 0.004, 3: 0.009})
    acc = Acceptance([Trace(runs=[3, 2, 1, 0, 5, 4, 3, 2, 1, 0])])
    ar, sd1, sd3 = Config("ar"), Config("sd", gamma=1), Config("sd", gamma=3)
    calibrate.fit_overheads(t, {ar: {"step_s": 0.0125, "reuse": 0.0}, sd1: {"step_s": 0.021, "reuse": 0.0},
                                sd3: {"step_s": 0.012, "reuse": 0.0}})
    assert t.overhead["ar"][0] == pytest.approx(0.0025) and t.overhead["sd"][1] == pytest.approx(0.021 - 0.017)
    assert predict(ar, t, acc)["step_s"] == pytest.approx(0.0125, rel=1e-12)
    assert predict(sd1, t, acc)["step_s"] == pytest.approx(0.021, rel=1e-12)
    assert predict(sd3, t, acc)["step_s"] == pytest.approx((0.009 + 0.016) / 2, rel=1e-12)  # 12 ms < 25 ms / 2


def test_a_confirmation_adds_its_runs_to_the_probes(pipe):
    """run_configs with `sums` adds its runs to the earlier ones: the step time the probe's overhead is
    refitted to is over the probe run and the confirmation's runs together (counts, not speed)."""
    prompts = [pipe.encode("Once upon a time"), pipe.encode("The dog")]
    earlier = calibrate.run_configs(pipe, [Config("ar")], prompts[:1], 8, warm_up=False)[Config("ar")]
    assert earlier["sums"][:3] == (8, 8, 0)
    both = calibrate.run_configs(pipe, [Config("ar")], prompts[1:], 8, warm_up=False,
                                 sums={Config("ar"): earlier["sums"]})[Config("ar")]
    tokens, steps, reuses, seconds = both["sums"]
    assert (tokens, steps, reuses) == (16, 16, 0) and seconds > earlier["sums"][3]
    assert both["step_s"] == pytest.approx(seconds / 16, rel=1e-12)


def test_calibrate_predicts_each_ar_and_sd_probe_at_its_step_over_all_its_runs(pipe):
    """In a real calibration the table's prediction for an ar or sd probe is the step measured over all of
    its runs (the confirmation's too): the overheads are refitted after the confirmation. Checked with the
    profile's own timings, so whatever the machine's speed, only the fitting is compared."""
    cfg = calibrate.TuneConfig(prompts=2, max_tokens=8, kappas=(1,), gammas=(1,), reps=1, confirm=2,
                               confirm_prompts=2, min_seconds=0, exact_top=2, progress=False)
    prof = calibrate.calibrate(pipe, cfg)
    timings = prof.calibration["timings"]
    ar = next(r for r in prof.table if r["mode"] == "ar")
    assert ar["probe"] and ar["confirmed"]  # ar is always confirmed: it ran on both prompts
    checked = 0
    for r in prof.table:
        if r["probe"] and r["mode"] in ("ar", "sd"):
            g = r["gamma"] or 0
            window = timings.get("local_window") or timings["window"]  # sd drafts in-process where it can
            component = timings["verify"]["1"] if r["mode"] == "ar" else (
                window[str(g)] + timings["verify"][str(g + 1)])
            assert r["step_ms"] == pytest.approx(max(r["measured_step_ms"], 1e3 * component / 2), rel=1e-9)
            checked += 1
    assert checked == 2


# --- auto adapts to the text it serves ------------------------------------------------------------


def ranked(*configs: Config) -> list[dict]:
    return [{"config": c} for c in configs]


def test_the_confirmation_keeps_other_windows_measured():
    """At most ⌊n/2⌋ of the confirmed points share a γ: acceptance on the user's text moves whole γ groups."""
    order = ranked(*(Config("mirror", k, 1, 2) for k in (1, 2, 4, 8)), Config("sd", gamma=1), Config("sd", gamma=3),
                   Config("mirror", 2, 3, 2), Config("mirror", 2, 2, 2))
    picked = calibrate.pick_confirm(order, 5)
    assert [c.gamma for c in picked] == [1, 1, 3, 3, 2]
    assert picked[:2] == [r["config"] for r in order[:2]]
    assert [c.gamma for c in calibrate.pick_confirm(order, 2)] == [1, 3]


# α = 0.6 in calibration at every γ: sd γ=1 (1.6 tokens in 15 ms) beats ar (10 ms) and mirror γ=3 (2.3 in 25 ms)
ADAPTING = profiles.Profile(key={}, mode="sd", gamma=1, why="tuned",
                            calibration={"acceptance": {"1": [60, 40], "3": [120, 80]}},
                            table=[profile_row("ar", None, 1.0, 10.0), profile_row("sd", 1, 1.6, 15.0),
                                   profile_row("mirror", 3, 2.3, 25.0, kappa=2, exit_layer=2)])


def reading(pipe, profile: profiles.Profile) -> Pipeline:
    """A new pipeline over `pipe`'s models (auto has seen nothing yet) that reads `profile` as its own."""
    fresh = Pipeline(pipe.model, pipe.tokenizer, pipe.draft, pipe.engine.exit_adapter)
    fresh.auto.profile = profiles.Profile(**{**profile.__dict__, "key": profiles.pipe_key(fresh)})
    return fresh


TREE_FASTEST = profiles.Profile(key={}, mode="recycle", why="tuned", calibration={"acceptance": {"1": [60, 40]}},
                                table=[profile_row("ar", None, 1.0, 10.0), profile_row("sd", 1, 1.2, 15.0),
                                       profile_row("recycle", None, 1.4, 11.0)])


def test_auto_runs_the_recycled_tree_beside_a_draft_that_does_not_pay(pipe):
    """Where the calibration measured the recycled tree with the lookup faster than the draft and than ar, auto
    runs it (no draft window: the draft model waits), says so, and stays lossless at T=0 and T=1 (a seeded
    sample is the target's own: the same text as ar with that seed)."""
    model, tokenizer = mlx_load(str(TARGET_PATH))
    fresh = reading(pipe, TREE_FASTEST)
    try:
        result = fresh.generate(PROMPT, max_tokens=40)
        s = result.stats
        assert (describe(s), s.recycle, s.lookup, s.draft_forwards) == ("recycle", "tree", True, 0)
        assert s.why == "auto: tuned" and s.proposed > 0
        assert_lossless(result.tokens, reference_greedy(model, tokenizer.encode(PROMPT), 40))
        sampled = fresh.generate(PROMPT, max_tokens=24, temperature=1.0, seed=3)
        alone = fresh.generate(PROMPT, max_tokens=24, temperature=1.0, seed=3, mode="ar")
        assert describe(sampled.stats) == "recycle" and sampled.tokens == alone.tokens
        off = fresh.generate(PROMPT, max_tokens=8, lookup=False).stats  # the lookup asked off: the tree alone
        assert (describe(off), off.lookup) == ("recycle", False)
    finally:
        fresh.close()
    # a draft that stops paying in auto's own runs hands over to the tree, as it would to ar
    lost = policy.adapt(TREE_FASTEST.__class__(**{**TREE_FASTEST.__dict__, "mode": "sd", "gamma": 1}),
                        {SD1: [10, 90, 0, 0]})
    assert lost.mode == "recycle" and "right 0." in lost.why


def test_the_calibration_counts_acceptance_as_a_real_run_does():
    """Replayed at γ, a trace counts accepted draft tokens and rejecting steps as Stats does."""
    acc = Acceptance([Trace(runs=[3, 2, 1, 0, 0, 5, 4, 3, 2, 1, 0])])
    # γ=2: steps at 0 (2 accepted), 3 (0: rejected), 4 (0: rejected), 5 (2), 8 (2); the text ends at 11
    assert acc.window_counts(2) == (6, 2)
    # γ=7: steps at 0 (3 of 7: rejected), 4 (0: rejected), 5 (5: rejected)
    assert acc.window_counts(7) == (8, 3)


SD1, MIRROR3 = ("sd", None, 1, None), ("mirror", 2, 3, 2)  # AutoState.seen keys: (mode, κ, γ, ℓe)
GREEDY, T1 = (0.0, None), (1.0, 1.0, 0, 0.0, None)  # DecodeOptions.sampling at temperature 0 and 1


def test_auto_moves_to_longer_windows_on_predictable_text_and_to_ar_on_unpredictable():
    assert policy.adapt(ADAPTING, {}) is None  # nothing seen: the profile's choice
    same = policy.adapt(ADAPTING, {SD1: [6, 4, 0, 0]})  # as predictable as the calibration text
    assert (same.mode, same.gamma) == ("sd", 1) and "right 1.00x as often" in same.why
    easy = policy.adapt(ADAPTING, {SD1: [900, 100, 0, 0]})  # α -> (0.6 * 64 + 900) / 1064 = 0.88, 1.47x
    assert (easy.mode, easy.kappa, easy.gamma, easy.exit_layer) == ("mirror", 2, 3, 2)
    assert "at temperature 0 the draft is right 1.47x as often in auto's runs (1000 draft tokens judged)" in easy.why
    hard = policy.adapt(ADAPTING, {SD1: [20, 980, 0, 0]})  # 0.09x: one token a step at sd's step time
    assert hard.mode == "ar" and "right 0.09x as often" in hard.why
    both = policy.adapt(ADAPTING, {SD1: [900, 100, 0, 0], MIRROR3: [20, 980, 0, 0]})  # ratios weighted by tokens
    assert "right 0.78x as often" in both.why
    near = policy.adapt(ADAPTING, {SD1: [800, 200, 0, 0]})  # 1.31x: mirror γ=3 3 % faster than sd γ=1, within noise
    assert (near.mode, near.gamma) == ("sd", 1) and "so the tuned choice" in near.why


# Mirror-SD κ=2 γ=3 tuned (2.3 tokens in 20 ms, a branch reused on 80 % of the steps); a fallback costs the
# draft's serial window, 20 ms at γ=3: at α as calibrated, it stays fast only while its branches are reused
REUSING = profiles.Profile(key={}, mode="mirror", kappa=2, gamma=3, exit_layer=2, why="tuned",
                           calibration={"acceptance": {"3": [120, 80]}, "timings": {"window": {"3": 0.020}}},
                           table=[profile_row("ar", None, 1.0, 10.0),
                                  dict(profile_row("mirror", 3, 2.3, 20.0, 2, 2), reuse=0.8)])


def test_auto_counts_the_serial_windows_of_branches_it_could_not_reuse():
    """Eq. 10's fallback cost: a reuse lost adds the draft's serial window to the measured step."""
    kept = policy.adapt(REUSING, {MIRROR3: [600, 400, 80, 20]}, "temperature 1")  # α and reuse as calibrated
    assert (kept.mode, kept.gamma) == ("mirror", 3) and "reused 1.00x as often as predicted (100 steps)" in kept.why
    # reuse (0.8 * 16 + 5) / 116 = 0.15: 0.65 of a 20 ms window more per step, 2.3 tokens in 33 ms < ar's 1 in 10
    lost = policy.adapt(REUSING, {MIRROR3: [600, 400, 5, 95]}, "temperature 1")
    assert lost.mode == "ar" and "at temperature 1 the draft is right 1.00x" in lost.why
    assert "reused 0.19x as often as predicted (100 steps)" in lost.why
    seen = policy.observed(REUSING, {MIRROR3: [600, 400, 5, 95]})
    assert cost_model.expected_rate(REUSING.table[1], seen) == pytest.approx(2300 / (20 + (0.8 - 0.8 * seen.reuse) * 20))


def test_auto_adapts_per_sampling_setting_stays_lossless_and_learns_only_from_its_own_runs(pipe):
    model, tokenizer = mlx_load(str(TARGET_PATH))
    fresh = reading(pipe, ADAPTING)
    try:
        fresh.auto.seen[GREEDY] = {SD1: [900, 100, 0, 0]}
        sampled = fresh.generate(PROMPT, max_tokens=8, temperature=1.0, seed=0).stats
        assert (sampled.chosen_mode, sampled.why) == ("sd", "auto: tuned")  # nothing seen at temperature 1 yet
        assert fresh.auto.seen[T1] == {SD1: [sampled.accepted, sampled.rejections, 0, 0]}
        result = fresh.generate(PROMPT, max_tokens=40)
        s = result.stats
        assert (s.chosen_mode, s.kappa, s.gamma) == ("mirror", 2, 3)
        assert s.why.startswith("auto: adapted: at temperature 0 the draft is right")
        assert_lossless(result.tokens, reference_greedy(model, tokenizer.encode(PROMPT), 40))
        assert s.proposed >= s.accepted + s.rejections and s.rejections <= s.steps
        assert sum(result.from_draft) <= s.accepted <= sum(result.from_draft) + 3  # (max_tokens may cut the last window)
        assert fresh.auto.seen[GREEDY] == {SD1: [900, 100, 0, 0],
                                                  MIRROR3: [s.accepted, s.rejections, s.reuses, s.fallbacks]}
        explicit = fresh.generate(PROMPT, max_tokens=16, mode="sd", gamma=2).stats
        assert explicit.proposed > 0 and ("sd", None, 2, None) not in fresh.auto.seen[GREEDY]
        custom = fresh.generate(PROMPT, max_tokens=8, sampler=lambda logprobs: mx.argmax(logprobs, axis=-1)).stats
        assert custom.proposed > 0 and len(fresh.auto.seen) == 2  # a custom sampler: nothing to key it by
        # unpredictable sampled text: auto leaves the draft at temperature 1, and a seed samples the same text
        fresh.auto.seen[T1] = {SD1: [20, 980, 0, 0]}
        hard = fresh.generate(PROMPT, max_tokens=16, temperature=1.0, seed=3)
        assert hard.stats.chosen_mode == "ar" and hard.stats.why.startswith("auto: adapted: at temperature 1 ")
        assert_lossless(hard.tokens,
                        fresh.generate(PROMPT, max_tokens=16, temperature=1.0, seed=3, mode="sd", gamma=1).tokens)
    finally:
        fresh.close()


# mirror κ=2 γ=3 chosen: α 0.95 in calibration, 3.7 tokens in 36 ms (103 tok/s), just above ar (10 ms: 100 tok/s)
LEAVING = profiles.Profile(key={}, mode="mirror", kappa=2, gamma=3, exit_layer=2, why="tuned",
                           calibration={"acceptance": {"3": [190, 10]}},
                           table=[profile_row("ar", None, 1.0, 10.0),
                                  dict(profile_row("mirror", 3, 3.7, 36.0, 2, 2), reuse=0.9)])


def test_auto_leaves_the_draft_within_a_generation_once_the_text_at_hand_defeats_it():
    test = policy.leave_draft(LEAVING, cost_model.Choice("mirror", 2, 3, 2))
    assert test([2, 10, 0, 10]) is None  # 12 draft tokens judged: too few to tell
    assert test([45, 2, 11, 1]) is None  # as predictable as the calibration text: stay
    # α (0.95 * 8 + 4) / 30 = 0.39, 0.41x: 1.59 tokens a step in 36 ms, 44 tok/s against ar's 100
    why = test([4, 18, 2, 16])
    assert why == ("the draft is right 0.41x as often in this text (22 draft tokens judged) as in calibration, "
                   "its branches reused 0.28x as often as predicted: 44 tok/s expected, ar 100")
    assert policy.leave_draft(LEAVING, cost_model.Choice("ar")) is None  # nothing to leave
    assert policy.leave_draft(LEAVING, cost_model.Choice("sd", gamma=3)) is None  # not measured: nothing to compare


def test_auto_goes_on_with_ar_mid_generation_losslessly_and_says_so(pipe):
    model, tokenizer = mlx_load(str(TARGET_PATH))
    fresh = reading(pipe, LEAVING)
    try:
        result = fresh.generate(PROMPT, max_tokens=48)
        s = result.stats
        assert_lossless(result.tokens, reference_greedy(model, tokenizer.encode(PROMPT), 48))
        assert (s.mode, s.chosen_mode, s.kappa, s.gamma, s.exit_layer) == ("mirror", "mirror", 2, 3, 2)
        assert s.left_draft.startswith("after step ") and s.left_draft.endswith("ar 100"), s.left_draft
        left_at = int(s.left_draft.split()[2].rstrip(":"))
        assert 1 <= left_at < s.steps == s.target_forwards  # every later step is the target's alone: one token
        assert len(result.from_draft) == 48 and not any(result.from_draft[-(s.steps - left_at):])
        assert f"left the draft {s.left_draft}" in s.summary()
        assert fresh.auto.seen[GREEDY] == {MIRROR3: [s.accepted, s.rejections, s.reuses, s.fallbacks]}
        explicit = fresh.generate(PROMPT, max_tokens=48, mode="mirror", kappa=2, gamma=3, exit_layer=2).stats
        assert explicit.left_draft == "" and explicit.steps < s.steps  # an explicit mode is kept
        # sampled: auto leaves the draft too, and a seed samples the same text as the target alone
        sampled = fresh.generate(PROMPT, max_tokens=32, temperature=1.0, seed=5)
        assert sampled.stats.left_draft
        assert_lossless(sampled.tokens,
                        fresh.generate(PROMPT, max_tokens=32, temperature=1.0, seed=5, mode="ar").tokens)
    finally:
        fresh.close()


def test_tune_reports_a_chosen_point_whose_suffix_and_rollout_were_not_timed_together():
    """pick_confirm can confirm a point past the measured top: its report says so instead of failing."""
    timings = {"suffix": {"(3, 3)": 0.1}, "rollout": {"(6, 2)": 0.08}, "parallel": {}}
    prof = profiles.Profile(key={}, mode="mirror", kappa=2, gamma=2, exit_layer=3, calibration={"timings": timings})
    assert "not timed together" in report.contention(prof) and "max(100.00, 80.00) ms apart" in report.contention(prof)
    timings["parallel"]["(3, 2, 2)"] = 0.12
    assert "120.00 ms together" in report.contention(prof) and "1.20× the ideal" in report.contention(prof)


def test_tune_quick_out_of_budget_says_so_in_one_line(monkeypatch):
    """A busy machine can outlast --quick's cap: one line naming the budget and the way out, no traceback."""
    monkeypatch.setenv("MIRROR_MLX_QUICK_BUDGET", "0")
    r = CliRunner().invoke(main, ["tune", "--quick", "--model", str(TARGET_PATH), "--draft-model", str(DRAFT_PATH)])
    assert r.exit_code == 1, r.output
    assert "calibration passed its 0 s budget: nothing saved; raise MIRROR_MLX_QUICK_BUDGET" in r.output
    assert "Traceback" not in r.output
