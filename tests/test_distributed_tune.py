"""`mirror-mlx tune` across ranks: T_comm (the target's collectives per forward) is a term of the step model,
and on loopback (2 ranks of the ring backend, set up as mlx.launch sets them up) tune completes on every
rank, rank 0 alone writes one profile, kept apart by rank count, whose rows carry T_comm, and a following
`generate --mode auto` on 2 ranks runs that profile's choice and returns mlx-lm's greedy tokens."""

import json
import os
import sys
from copy import deepcopy
from dataclasses import replace

import pytest
from mlx_lm.utils import load

from mirror_mlx.bench.ranks import RankResult, run_ranks
from mirror_mlx.demo import TARGET
from mirror_mlx.tune.timing import split_comm
from mirror_mlx.tune.cost_model import Acceptance, Config, Timings, Trace, predict
from tests.support import assert_lossless, reference_greedy
from tests.support.ranks import ROOT

pytestmark = pytest.mark.usefixtures("one_group_at_a_time")  # (conftest.py: one group of ranks at a time)

CONFIGS = [Config("ar"), Config("sd", gamma=3), Config("mirror", 1, 3, 2)]


def pieces() -> tuple[Timings, Acceptance]:
    """One process's timings of a 4-layer target (ℓ_e = 2, γ = 3: 4 rows) and a trace."""
    t = Timings(verify={1: 0.010, 4: 0.013}, window={3: 0.004}, prefix={(2, 4): 0.006}, suffix={(2, 4): 0.007},
                rollout={(4, 3): 0.003}, overhead={"ar": 1e-3, "sd": 2e-3, "mirror": 3e-3})
    runs = [2, 1, 0] * 10
    return t, Acceptance([Trace(runs=runs, rank_excl={2: [0] * 30}, rank_plain={2: [0] * 30})])


def test_t_comm_adds_each_step_the_collectives_of_its_target_forwards_and_nothing_in_one_process():
    t, acc = pieces()
    alone = {c: predict(c, t, acc) for c in CONFIGS}
    assert all(p["comm_s"] == 0.0 for p in alone.values())
    assert alone[CONFIGS[0]]["step_s"] == 0.010 + 1e-3  # ar: one 1-row forward, no term added in one process
    # across ranks: a whole forward's collectives over 1 and 4 rows, 1 ms of the 4-row ones before ℓ_e = 2
    ranks = replace(t, comm={1: 0.002, 4: 0.005}, comm_prefix={(2, 4): 0.001})
    across = {c: predict(c, ranks, acc) for c in CONFIGS}
    for c, grows in zip(CONFIGS, (0.002, 0.005, 0.005)):  # ar: 1 row; sd: its γ+1 verified; mirror: prefix + suffix
        assert across[c]["step_s"] == pytest.approx(alone[c]["step_s"] + grows, abs=1e-12), c
        assert across[c]["comm_s"] == pytest.approx(grows), c
        assert across[c]["tokens_per_second"] < alone[c]["tokens_per_second"]
    # suffix ‖ rollout measured together holds the suffix's collectives already: only the prefix's are added
    ranks.parallel[(2, 1, 3)] = t.parallel[(2, 1, 3)] = 0.008
    mirror = CONFIGS[2]
    assert predict(mirror, ranks, acc)["step_s"] == pytest.approx(predict(mirror, t, acc)["step_s"] + 0.001, abs=1e-12)


def test_split_comm_keeps_the_measured_pieces_predictions_and_makes_t_comm_a_term_of_its_own():
    """Across ranks each target piece is timed with its collectives in it: split off, the prediction is the
    measured pieces' own, and T_comm is in it once (ℓ_e of the N layers' share before the exit)."""
    measured, acc = pieces()
    split = deepcopy(measured)
    split_comm(split, {1: 0.002, 4: 0.004}, n_layers=4)
    assert split.comm_prefix == {(2, 4): 0.002} and split.verify[1] == pytest.approx(0.008)
    assert split.suffix[(2, 4)] == pytest.approx(0.005)
    for c in CONFIGS:
        assert predict(c, split, acc)["step_s"] == pytest.approx(predict(c, measured, acc)["step_s"], abs=1e-12), c
        assert predict(c, split, acc)["comm_s"] > 0


def launch(command: list[str], cache, timeout: float = 300) -> RankResult:
    """`mirror-mlx COMMAND` on 2 ranks set up as mlx.launch sets them up (mirror_mlx/bench/ranks.py); rank 0's
    output, once every rank ended well."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT), MIRROR_MLX_CACHE=str(cache))
    ranks = run_ranks([sys.executable, "-m", "mirror_mlx", *command], 2, timeout, env, cache.parent)
    for r, got in enumerate(ranks):
        assert got.returncode == 0, f"rank {r}: {got.stderr[-3000:]}"
    return ranks[0]


@pytest.mark.timeout(400)
def test_tune_on_two_ranks_writes_one_profile_with_t_comm_that_auto_on_two_ranks_runs_losslessly(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    # two prompts and --min-seconds: the real runs repeat until rank 0 has decoded long enough (its decision)
    tuned = launch(["tune", "--limit", "2", "--max-tokens", "8", "--confirm", "2", "--min-seconds", "0.5"], cache)
    assert "chose " in tuned.stdout and "T_comm across 2 ranks" in tuned.stdout, tuned.stdout
    files = list(cache.glob("profile-*.json"))
    assert len(files) == 1, files  # rank 0's alone (rank 1's shard would key another file)
    prof = json.loads(files[0].read_text())
    assert prof["key"]["ranks"] == 2 and prof["calibration"]["ranks"] == 2
    comm = {int(n): s for n, s in prof["calibration"]["timings"]["comm"].items()}
    assert comm and all(s > 0 for s in comm.values())
    for row in prof["table"]:  # each row's step holds the T_comm of its forwards
        rows = 1 if row["mode"] == "ar" else row["gamma"] + 1
        assert row["comm_ms"] == pytest.approx(1e3 * comm[rows]), row
    assert any(row.get("confirmed") and row.get("measured") for row in prof["table"])

    # one process never reads it: its key (no rank count, the whole target) names another file
    import mirror_mlx
    from mirror_mlx.tune import profile as profiles

    monkeypatch.setenv("MIRROR_MLX_CACHE", str(cache))
    pipe = mirror_mlx.load()
    try:
        assert profiles.saved(profiles.pipe_key(pipe)) is None
    finally:
        pipe.close()

    out = launch(["generate", "--mode", "auto", "--max-tokens", "24", "--json", "--prompt", "Once upon a time"], cache)
    got = json.loads(out.stdout)
    stats = got["stats"]
    assert stats["why"].startswith("auto: the tuned profile of 2 ranks"), stats["why"]
    assert (stats["mode"], stats["gamma"] if stats["mode"] != "ar" else None) == (prof["mode"], prof["gamma"])
    model, tokenizer = load(str(TARGET))
    ids = mirror_mlx.text.cli_prompt(tokenizer, "Once upon a time", None, tokenizer.has_chat_template, {})
    ref = reference_greedy(model, ids, 24)
    assert_lossless(got["tokens"], ref[: len(got["tokens"])], (got["tokens"], ref))
    assert len(got["tokens"]) == 24, (got["tokens"], ref)

    # an explicit mode without its knobs takes them from the same profile, as one process takes its own
    from mirror_mlx.tune.policy import knobs_from

    expected = knobs_from(profiles.saved(prof["key"]), None, "sd", None, None, None)
    out = launch(["generate", "--mode", "sd", "--max-tokens", "24", "--json", "--prompt", "Once upon a time"], cache)
    got = json.loads(out.stdout)
    stats = got["stats"]
    assert "from the tuned profile of 2 ranks" in stats["why"], stats["why"]
    assert (stats["mode"], stats["gamma"]) == ("sd", expected.gamma), (stats, expected)
    assert_lossless(got["tokens"], ref[:24], (got["tokens"], ref))


class Ranks:
    """Rank 0 of 2 without a launcher: what `DistributedPipeline` asks of its group (`agree` is stubbed)."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


def across_two_ranks(pipe):
    """The demo pair as rank 0 of 2 sees it: `agree` hands back rank 0's values, as every rank gets them."""
    from mirror_mlx.distributed.faults import Watchdog
    from mirror_mlx.distributed.pipeline import DistributedPipeline

    pipe.__class__ = DistributedPipeline
    pipe.group, pipe.watchdog = Ranks(), Watchdog(120)
    pipe.agree = lambda values, size, what: (list(values) + [0] * size)[:size]
    return pipe


def test_modes_resolve_across_ranks_as_in_one_process_from_rank_0s_profile(tmp_path, monkeypatch):
    """No mode logic of its own: `Pipeline.prepare` resolves, with the profile rank 0 read for this rank count
    (shared as JSON), else a stand-in of mirror with the small safe knobs; nothing calibrates across ranks."""
    import mirror_mlx
    from mirror_mlx.tune import profile as profiles

    monkeypatch.setenv("MIRROR_MLX_CACHE", str(tmp_path))
    pipe = across_two_ranks(mirror_mlx.load())
    try:
        monkeypatch.setattr("mirror_mlx.tune.calibrate.calibrate", lambda *a, **k: pytest.fail("calibrated"))
        plan = pipe.resolve(pipe.plan("Once upon a time", max_tokens=8))
        auto, run = plan.opts, plan.run
        assert (auto.mode, auto.kappa, auto.gamma, run) == ("mirror", 1, 3, None)
        assert auto.why.startswith("auto: mirror (no tuning profile for these ranks") and "auto keeps" in auto.why
        sd = pipe.resolve(pipe.plan("Once upon a time", max_tokens=8, mode="sd")).opts
        assert (sd.mode, sd.gamma) == ("sd", 3) and "small safe defaults, uncalibrated" in sd.why
        sampled = pipe.resolve(pipe.plan("Once upon a time", max_tokens=8, temperature=0.7)).opts
        assert sampled.seed is not None  # rank 0's, on every rank

        key = profiles.pipe_key(pipe)
        assert key["ranks"] == 2
        table = [dict(mode="ar", kappa=None, gamma=None, exit_layer=None, predicted=100.0),
                 dict(mode="sd", kappa=None, gamma=4, exit_layer=None, predicted=150.0),
                 dict(mode="mirror", kappa=2, gamma=3, exit_layer=2, predicted=200.0)]
        profiles.save(profiles.Profile(key=key, mode="mirror", kappa=2, gamma=3, exit_layer=2, why="tuned",
                                       table=table))
        pipe.auto.profile = None  # (read anew: the next call that needs it shares it)
        auto = pipe.resolve(pipe.plan("Once upon a time", max_tokens=8)).opts
        assert (auto.mode, auto.kappa, auto.gamma, auto.exit_layer) == ("mirror", 2, 3, 2)
        assert auto.why.startswith("auto: the tuned profile of 2 ranks, mirror κ=2 γ=3 ℓe=2: tuned"), auto.why
        sd = pipe.resolve(pipe.plan("Once upon a time", max_tokens=8, mode="sd")).opts
        assert sd.gamma == 4 and "from the tuned profile of 2 ranks" in sd.why, sd.why

        pipe.split, pipe.auto.profile = "pipeline", None  # split by layers: tune measures none, so the stand-in
        auto = pipe.resolve(pipe.plan("Once upon a time", max_tokens=8)).opts
        assert (auto.mode, auto.kappa, auto.gamma) == ("mirror", 1, 3) and "split by layers" in auto.why
    finally:
        pipe.close()
