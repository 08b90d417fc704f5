"""The draft host: the draft in its own process behind the TokenRing, and every way that can end.

A host that dies, stalls or raises is a visible switch to `ar` with the target's own tokens, and leaves
no process and no shared-memory segment behind; the API works from inside a running event loop.
"""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mlx_lm import load

from mirror_mlx.drafts.host import DraftHost, DraftHostError

from mirror_mlx.drafts.recipes import DraftRecipe, mlx_draft, ss_draft
from mirror_mlx.drafts.mlx_draft import MLXDraft
from mirror_mlx.pipeline import Pipeline, load_draft
from tests import leaks
from tests.models import DEMO, DRAFT_PATH, TARGET_PATH
from tests.support import assert_lossless, reference_greedy

PROMPT_TEXT = "Once upon a time, there was a little girl named Lily"
ROOT = Path(__file__).resolve().parents[1]


class _Broken(MLXDraft):
    """Rolls out normally `fail_after` times, then raises (or sleeps `stall` s, or kills its own process)."""

    def __init__(self, model, fail_after: int, how: str):
        super().__init__(model)
        self.calls, self.fail_after, self.how = 0, fail_after, how

    def rollout(self, context, stems, gamma):
        self.calls += 1
        if self.calls > self.fail_after:
            if self.how == "raise":
                raise RuntimeError("draft exploded")
            if self.how == "stall":
                time.sleep(60)
            if self.how == "die":
                os.kill(os.getpid(), signal.SIGKILL)
        return super().rollout(context, stems, gamma)


def broken_draft(path: str, fail_after: int, how: str) -> MLXDraft:
    """A DraftRecipe builder: runs inside the host process."""
    from mlx_lm.utils import load_model

    return _Broken(load_model(Path(path))[0], fail_after, how)


def _gone(host_pid: int, rings: list) -> bool:
    """The host process is reaped and neither ring's shared memory segment can be opened any more."""
    try:
        os.kill(host_pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    return not alive and not leaks.leaked(rings)


@pytest.fixture(scope="module")
def target():
    return load(str(TARGET_PATH))


@pytest.fixture(scope="module")
def reference(target):
    model, tokenizer = target
    prompt = tokenizer.encode(PROMPT_TEXT)
    return prompt, reference_greedy(model, prompt, 64)


def _pipe(target, recipe):
    model, tokenizer = target
    pipe = Pipeline(model, tokenizer, recipe)
    host = pipe.engine.host
    return pipe, host.pid, [host.req.ring.name, host.rep.ring.name]


@pytest.mark.parametrize("mode,how,says", [("mirror", "raise", "exploded"), ("mirror", "stall", "timed out"),
                                           ("sd", "stall", "timed out"), ("sd", "die", "exited")])
def test_a_host_that_raises_stalls_or_dies_is_a_visible_switch_to_ar(target, reference, capsys, how, says, mode):
    pipe, pid, rings = _pipe(target, DraftRecipe(broken_draft, (str(DRAFT_PATH), 3, how)))
    prompt, ref = reference
    out = pipe.generate(prompt, max_tokens=64, mode=mode, kappa=8, gamma=7, stop=False, draft_timeout=1.0 if how == "stall" else 30.0)
    assert_lossless(out.tokens, ref)
    assert out.stats.draft_host == "process"
    assert out.stats.draft_failure and says in out.stats.draft_failure
    assert "continuing with the target alone" in capsys.readouterr().err
    assert _gone(pid, rings), "the dropped host left a process or a shared-memory segment"
    again = pipe.generate(prompt, max_tokens=16, mode=mode, kappa=8, gamma=7, stop=False)  # the pipeline stays usable, in ar
    assert_lossless(again.tokens, ref[:16])
    assert again.stats.mode == "ar"
    t0 = time.perf_counter()
    pipe.close()
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("when", ["mid-generation", "between generations"])
def test_a_host_killed_from_outside(target, reference, capsys, when):
    pipe, pid, rings = _pipe(target, load_draft(DRAFT_PATH, target[1]))
    prompt, ref = reference
    if when == "between generations":
        os.kill(pid, signal.SIGKILL)
    tokens = []
    for i, chunk in enumerate(pipe.stream(prompt, max_tokens=64, stop=False, mode="mirror", kappa=8, gamma=7)):  # auto may pick ar
        tokens += chunk.tokens
        if i == 1 and when == "mid-generation":
            os.kill(pid, signal.SIGKILL)
    assert_lossless(tokens, ref)
    assert "exited" in pipe.stats.draft_failure and "continuing with the target alone" in capsys.readouterr().err
    assert _gone(pid, rings)
    pipe.close()


def test_close_after_a_stall_returns_within_its_grace_and_ends_the_process():
    host = DraftHost(DraftRecipe(broken_draft, (str(DRAFT_PATH), 0, "stall")))
    pid, rings = host.pid, [host.req.ring.name, host.rep.ring.name]
    host.post_rollout([1, 2, 3], [[4]], 3)
    with pytest.raises(TimeoutError):
        host.rep.recv(0.3)
    t0 = time.perf_counter()
    host.close(grace=0.5)
    assert time.perf_counter() - t0 < 0.5 + 2.0  # grace, then SIGTERM (a stalled host does not answer STOP)
    assert _gone(pid, rings)


def test_two_closes_at_once_end_the_host_once_and_neither_fails():
    """The engine drops a failed host on its loop thread while a signal's exit closes it on the main thread: the
    later close waits for the one in course, then finds the host closed."""
    import threading

    host = DraftHost(broken_draft(str(DRAFT_PATH), 0, "stall"), process=False)  # a thread that stalls: a slow close
    rings = [host.req.ring.name, host.rep.ring.name]
    host.post_rollout([1, 2, 3], [[4]], 3)
    failed = []

    def close_slowly():
        try:
            host.close(grace=1.0)  # waits out its grace for the stalled thread
        except Exception as e:  # noqa: BLE001 - what this test looks for
            failed.append(e)

    first = threading.Thread(target=close_slowly)
    first.start()
    time.sleep(0.3)
    host.kill()  # the second close, inside the first's grace
    first.join(10)
    assert not failed and not first.is_alive() and host.req is None
    assert not leaks.leaked(rings)


def test_host_answers_what_the_draft_would_and_reports_bad_recipes():
    model, _ = load(str(DRAFT_PATH))
    local = MLXDraft(model)
    ctx, stems = [1, 403, 407, 261, 378], [[5], [9, 7], [9, 10, 11]]  # spine-shaped, as the engine's
    want = local.rollout(ctx, stems, 4).windows
    for process in (True, False):
        recipe = DraftRecipe(mlx_draft, (str(DRAFT_PATH),))
        host = DraftHost(recipe, process=process)
        assert host.vocab_size == 512 and host.kind == "MLXDraft"
        assert host.rollout(ctx, stems, 4, timeout=30).windows == want
        assert host.rollout(ctx + [5, 9], [[2]], 3, timeout=30).windows == local.rollout(ctx + [5, 9], [[2]], 3).windows
        host.reset(timeout=30)
        assert host.rollout(ctx, stems, 4, timeout=30).windows == want
        host.close()
    with pytest.raises(DraftHostError, match="could not build its draft"):
        DraftHost(DraftRecipe(mlx_draft, ("/nonexistent/draft",)))


def test_a_prepare_is_answered_before_the_rollout_after_it_and_changes_no_window():
    """Mirror posts the committed tokens and the window before the target's prefix (nothing waits for it);
    the rollout's answer is read after its acknowledgement, and the windows are the same."""
    model, _ = load(str(DRAFT_PATH))
    ctx, spine = [1, 403, 407, 261, 378], [9, 10, 11, 12]  # the window: γ = 4
    stems = [spine[:r] + [v] for r in range(5) for v in (5, 7)]
    want = MLXDraft(model).rollout(ctx, stems, 4).windows
    host = DraftHost(DraftRecipe(mlx_draft, (str(DRAFT_PATH),)), process=True)
    try:
        host.post_prepare(ctx + spine)
        assert host.rollout(ctx, stems, 4, timeout=30).windows == want
        host.post_prepare(ctx + [5, 9])  # a prepare whose rollout never comes: the next answer still lines up
        host.reset(timeout=30)
        assert not host.owed and host.rollout(ctx, stems, 4, timeout=30).windows == want
        host.post_prepare(ctx + spine)
        host.post_branches(ctx, spine, [[5, 7]] * 5)
        out, start, end = asyncio.run(host.windows(4))
        assert out.windows == want and start <= end
    finally:
        host.close()


def test_the_sync_api_and_an_async_stream_work_inside_a_running_event_loop(target, reference):
    pipe, _, _ = _pipe(target, load_draft(DRAFT_PATH, target[1]))
    prompt, ref = reference

    async def app():
        ticks = 0

        async def heartbeat():  # the app's loop keeps running while a stream is awaited
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        beat = asyncio.ensure_future(heartbeat())
        sync = pipe.generate(prompt, max_tokens=32, stop=False).tokens  # blocks this loop, but works
        streamed = [t async for chunk in pipe.astream(prompt, max_tokens=32, stop=False) for t in chunk.tokens]
        beat.cancel()
        return sync, streamed, ticks

    sync, streamed, ticks = asyncio.run(app())
    assert_lossless(sync, ref[:32], "generate")
    assert_lossless(streamed, ref[:32], "stream")
    assert ticks > 1
    pipe.close()


EXIT_SCRIPT = textwrap.dedent("""
    import atexit, time
    atexit.register(lambda: print(time.time(), flush=True))  # runs last: threads joined, every handler done
    import mirror_mlx
    pipe = mirror_mlx.load()
    host = pipe.engine.host
    print(host.pid, host.req.ring.name, host.rep.ring.name)
    out = pipe.generate("Once upon a time", max_tokens=8, draft_timeout=1e-4, stop=False, mode="mirror", kappa=8, gamma=7)
    assert out.stats.draft_failure and "timed out" in out.stats.draft_failure, out.stats.draft_failure
    print(time.time(), flush=True)
""")  # no close(): the interpreter's exit must clean up on its own


@pytest.mark.timeout(1200)  # twenty processes in turn, on a loaded box
def test_drop_the_draft_by_timeout_then_exit_20_times(tmp_path):
    """Exit code 0 every time, within 5 s of the last token, no process or segment left.

    The 5 s hold for the exit's own work, which is where it could wait on anything (joining threads,
    closing hosts, every exit handler): the script stamps the time in its last exit handler. What comes
    after (freeing memory, the process ending and being seen to) only has to end: on a loaded 2-core box
    it has taken more than 5 s on its own."""
    script = tmp_path / "drop_and_exit.py"
    script.write_text(EXIT_SCRIPT)
    for batch in range(10):  # 2 at a time (2 cores): 20 runs
        procs = [subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        ended = {}
        deadline = time.monotonic() + 300
        while len(ended) < len(procs) and time.monotonic() < deadline:
            ended.update({p: time.time() for p in procs if p not in ended and p.poll() is not None})
            time.sleep(0.02)
        for p in procs:
            out, err = p.communicate(timeout=1)
            assert p.returncode == 0, err
            assert "continuing with the target alone" in err and "Traceback" not in err
            pid, req, rep, last_token, handled = out.split()
            assert float(handled) - float(last_token) < 5.0, "the exit waited on something"
            assert ended[p] - float(last_token) < 60.0, "the process did not end"
            assert _gone(int(pid), [req, rep])


def _native_libraries(pid: int) -> set[str]:
    """The site-packages distributions whose native libraries a process has mapped."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split("site-packages/")[1].split("/")[0] for line in maps if "site-packages/" in line}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc")
def test_a_host_of_mirror_mlx_s_own_drafts_loads_no_tokenizer_and_a_builder_of_yours_keeps_mlx_lm_whole():
    """A host needs the draft's weights, not its tokenizer (the engine's process checked it): for a model
    folder and an SS draft the host skips transformers, a second of CPU at every start."""
    for kind, recipe in (("MLXDraft", DraftRecipe(mlx_draft, (str(DRAFT_PATH),))),
                         ("SSDraft", DraftRecipe(ss_draft, (str(DEMO / "ss_draft"),)))):
        host = DraftHost(recipe)
        try:
            assert host.kind == kind
            assert "mlx" in _native_libraries(host.pid) and "tokenizers" not in _native_libraries(host.pid)
        finally:
            host.close()
    host = DraftHost(DraftRecipe(broken_draft, (str(DRAFT_PATH), 3, "raise")))  # imports mlx_lm.utils' load_model
    try:
        assert "tokenizers" in _native_libraries(host.pid)
    finally:
        host.close()


def test_no_runtime_module_imports_the_builders():
    runtime = ["mirror_mlx.engine.loop", "mirror_mlx.engine.target", "mirror_mlx.drafts.mlx_draft", "mirror_mlx.drafts.ring",
               "mirror_mlx.engine.workers",
               "mirror_mlx.pipeline", "mirror_mlx.cli", "mirror_mlx.drafts.host", "mirror_mlx.ane_draft.package_host",
               "mirror_mlx.ane_draft.package_format", "mirror_mlx.ane_draft.coreml_draft",
               "mirror_mlx.drafts.ss.draft"]
    code = f"import sys, importlib\nfor m in {runtime!r}: importlib.import_module(m)\n" \
           "print(sorted(m for m in sys.modules if m.startswith('mirror_mlx.convert')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


SIGNAL_SCRIPT = textwrap.dedent("""
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's Ctrl-C, even when this suite
    import mirror_mlx                                          # runs as a background job (SIGINT ignored)
    pipe = mirror_mlx.load()
    host = pipe.engine.host
    pipe.generate("Once upon a time", max_tokens=8, stop=False)  # mode auto's first call (calibration) is over
    print(host.pid, host.req.ring.name, host.rep.ring.name, flush=True)  # ready: decoding from here on
    while True:
        pipe.generate("Once upon a time", max_tokens=200, stop=False)
""")


@pytest.mark.parametrize("sig,group", [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_sigterm_or_ctrl_c_mid_generation_leaves_no_host_and_no_segment(tmp_path, sig, group):
    """Ctrl-C reaches the whole process group (the host ignores it; the engine's exit stops it);
    SIGTERM kills the engine at once (the host sees its pipe close, the resource tracker unlinks the rings).
    The first signal has to end it: there is no second.

    The script sets Python's own Ctrl-C handler first: a suite run as a background job (`nohup make
    test &`) starts every process with SIGINT ignored, and the script then never stopped (two local
    CI runs hung here so). It says it is ready once its first generation (mode auto's calibration) is
    over; the signal comes a second into the decoding after that."""
    script = tmp_path / "busy.py"
    script.write_text(SIGNAL_SCRIPT)
    p = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    ready = p.stdout.readline().split()
    if len(ready) != 3:
        p.kill()
        pytest.fail(f"the script did not get ready: {ready} {p.communicate()[1][-3000:]}")
    pid, req, rep = ready
    time.sleep(1.0)  # mid-generation
    os.killpg(p.pid, sig) if group else p.send_signal(sig)
    try:
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the first {signal.Signals(sig).name} did not stop the generating script")
        assert ("KeyboardInterrupt" in err) == (sig == signal.SIGINT), err[-2000:]
    finally:
        if p.poll() is None:  # a failed check leaves no busy process behind to slow the rest of the suite
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    deadline = time.monotonic() + 10
    while not _gone(int(pid), [req, rep]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(int(pid), [req, rep])
