"""Core placement is the product's choice per mode (mirror_mlx/tune/placement.py): mirror runs the placement
its profile row measured faster, ar and sd run unpinned, a caller's own pinning is left alone, and every
generation says where it ran. The profile rows here are written by hand (controlled input); no timing is
asserted."""

import os
import subprocess
import sys
import textwrap

import pytest

import mirror_mlx
from mirror_mlx.tune import placement
from mirror_mlx.tune import profile as profiles
from mirror_mlx.tune.calibrate import place_row
from mirror_mlx.tune.profile import Profile
from tests.support import assert_lossless

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                                reason="core placement needs Linux and two allowed cores")

KNOBS = dict(kappa=1, gamma=2, exit_layer=2)


def mirror_row(placement_name: str, **rates: float) -> dict:
    return dict(mode="mirror", **KNOBS, placement=placement_name, placements=rates, confirmed=True,
                measured=max(rates.values()), measured_step_ms=10.0, predicted=1.0, tokens_per_step=1.5, reuse=0.5)


def with_profile(pipe, *rows: dict) -> None:
    pipe.auto.profile = Profile(key={}, mode="mirror", **KNOBS, why="test rows", table=list(rows))


def affinities(pid=None) -> dict:
    out = {}
    for t in os.listdir(f"/proc/{pid or 'self'}/task"):
        try:
            out[int(t)] = os.sched_getaffinity(int(t))
        except OSError:
            pass
    return out


def test_mirror_runs_its_rows_split_placement_for_that_generation_only(pipe):
    with_profile(pipe, mirror_row("split", split=20.0, unpinned=10.0))
    cpus = sorted(os.sched_getaffinity(0))
    before, host_before = affinities(), affinities(pipe.engine.host.pid)
    stream = pipe.stream("Once upon a time", max_tokens=12, mode="mirror", **KNOBS)
    next(stream)  # the generation is running: both sides are placed
    during, host_during = affinities(), affinities(pipe.engine.host.pid)
    for _ in stream:
        pass
    assert pipe.stats.placement.startswith("split") and "tune measured split 20.0 vs unpinned 10.0" in pipe.stats.placement
    assert all(c == set(cpus[:-1]) for c in during.values())
    assert host_during and all(c == {cpus[-1]} for c in host_during.values())
    after = affinities()  # every thread gets its cores back, the draft host too
    assert all(after[t] == before[t] for t in before if t in after)
    assert all(c == host_before.get(t, set(cpus)) for t, c in affinities(pipe.engine.host.pid).items())


def test_split_generation_is_token_for_token_the_unpinned_one(pipe):
    with_profile(pipe, mirror_row("split", split=20.0, unpinned=10.0))
    split = pipe.generate("Tom and Lily", max_tokens=24, mode="mirror", **KNOBS)
    with_profile(pipe, mirror_row("unpinned", split=5.0, unpinned=10.0))
    plain = pipe.generate("Tom and Lily", max_tokens=24, mode="mirror", **KNOBS)
    ar = pipe.generate("Tom and Lily", max_tokens=24, mode="ar")
    assert split.stats.placement.startswith("split") and plain.stats.placement.startswith("unpinned")
    assert_lossless(split.tokens, ar.tokens, "split")
    assert_lossless(plain.tokens, ar.tokens, "unpinned")


def test_threads_that_come_and_go_during_a_split_generation_are_no_error(pipe):
    """A server starts and ends a thread per connection while a split generation pins every thread of the
    process: a thread that ends between being listed and being pinned is skipped, not an error."""
    import threading

    with_profile(pipe, mirror_row("split", split=20.0, unpinned=10.0))
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            t = threading.Thread(target=lambda: None)
            t.start()
            t.join()

    churners = [threading.Thread(target=churn) for _ in range(2)]
    for t in churners:
        t.start()
    try:
        for _ in range(40):
            with placement.split(pipe):
                pass
        assert pipe.generate("Tom and Lily", max_tokens=8, mode="mirror", **KNOBS).stats.placement.startswith("split")
    finally:
        stop.set()
        for t in churners:
            t.join()


def test_ar_and_sd_run_unpinned_whatever_the_mirror_rows_say(pipe):
    with_profile(pipe, mirror_row("split", split=20.0, unpinned=10.0))
    for mode, knobs in (("ar", {}), ("sd", {"gamma": 2})):
        before = affinities()
        r = pipe.generate("Once upon a time", max_tokens=8, mode=mode, **knobs)
        assert r.stats.placement == f"unpinned ({mode} uses every core)"
        assert all(affinities().get(t, c) == c for t, c in before.items())


def test_mirror_point_without_a_measured_placement_runs_unpinned_and_says_so(pipe):
    with_profile(pipe, dict(mirror_row("split", split=20.0, unpinned=10.0), gamma=5))  # another point
    r = pipe.generate("Once upon a time", max_tokens=8, mode="mirror", **KNOBS)
    assert r.stats.placement.startswith("unpinned (no profile row measured a placement")


def test_a_callers_own_pinning_is_held():
    p = mirror_mlx.load()
    try:
        unheld = dict(profiles.pipe_key(p))
        placement.hold(p, "Mac analog (test)")
        assert profiles.pipe_key(p) == dict(unheld, placement="Mac analog (test)")  # a profile of its own
        with_profile(p, mirror_row("split", split=20.0, unpinned=10.0))
        before = affinities()
        r = p.generate("Once upon a time", max_tokens=8, mode="mirror", **KNOBS)
        assert r.stats.placement == "held (held by the caller: Mac analog (test))"
        assert all(affinities().get(t, c) == c for t, c in before.items())
        assert placement.candidates(p) == ("unpinned",)  # tune measures no split then
    finally:
        p.close()


def test_tune_row_keeps_the_faster_placements_run():
    runs = {"unpinned": dict(tokens_per_second=10.0, step_s=0.2), "split": dict(tokens_per_second=12.5, step_s=0.16)}
    row = dict(mode="mirror", measured=10.0, measured_step_ms=200.0)
    place_row(row, runs)
    assert row["placement"] == "split" and row["placements"] == {"unpinned": 10.0, "split": 12.5}
    assert row["measured"] == 12.5 and row["measured_step_ms"] == pytest.approx(160.0)
    row = dict(mode="mirror", measured=10.0, measured_step_ms=200.0)
    place_row(row, dict(runs, split=dict(tokens_per_second=8.0, step_s=0.25)))
    assert row["placement"] == "unpinned" and row["measured"] == 10.0
    row = dict(mode="sd", measured=9.0, measured_step_ms=100.0)
    place_row(row, {"unpinned": dict(tokens_per_second=9.0, step_s=0.1), "split": None})
    assert row == dict(mode="sd", measured=9.0, measured_step_ms=100.0, placement="unpinned")


@pytest.mark.parametrize("library", ["blis", "openblas"])
def test_blas_threads_follow_the_cores_a_process_may_use(library):
    """The draft host's rule (blas.follow_affinity), in a process of its own started with two BLAS threads,
    for each library the product may preload."""
    code = textwrap.dedent("""
        import os, mirror_mlx
        import mlx.core as mx
        from mirror_mlx import blas
        mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4)))
        lib = os.path.realpath(blas.preload())
        start = blas.threads()[lib]
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        blas.follow_affinity()
        one = blas.threads()[lib]
        os.sched_setaffinity(0, set(range(os.cpu_count())))
        blas.follow_affinity()
        print(start, one, blas.threads()[lib])
    """)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="2", MIRROR_MLX_BLAS=library)
    env.pop("BLIS_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if "is not installed" in out.stderr or "no tuned BLAS" in out.stderr:
        pytest.skip(f"{library} is not installed here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "1", "2"]
