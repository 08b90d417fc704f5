"""Across Macs, on loopback: the target sharded over 2 ranks by `mlx.launch --backend ring`, the draft
beside rank 0. Greedy mirror and sd return mlx-lm's single-process greedy tokens, token for token, for a
sharded llama (the demo pair) and a sharded qwen3 (tiny random weights), 8 openings × 64 tokens under 3
(κ, γ, ℓe) settings each; a seeded sample equals the single-process one; both ranks commit the same
tokens; a rank killed mid-generation ends the run with one line, no process and no shared memory left.

Each family is one launcher run (tests/distributed_run.py runs every case on every rank). The ring's
collectives cost tens of milliseconds each on a loaded 2-core box (ten per forward of the demo target), so
each opening runs once, under one of the 3 settings, in mirror or sd by turns; MIRROR_MLX_DIST_FULL=1 runs
every opening under every setting in both modes.
"""

import json
import signal
import time
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.utils import load, save_config, save_model

from mirror_mlx.demo_pair import DRAFT, TARGET
from mirror_mlx.pipeline import Pipeline
from mirror_mlx.prompts import tinystories
from tests.leaks import made_in, wait_unlinked
from tests.models import CONFIGS, tiny_model

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port for rank 0 (rank 1 takes the next): each launch its own, as tests run side by side."""
    import socket

    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            try:
                b.bind(("127.0.0.1", a.getsockname()[1] + 1))
            except OSError:
                continue
            return a.getsockname()[1]


def launcher() -> list[str]:
    return [str(Path(sys.executable).parent / "mlx.launch"), "-n", "2", "--backend", "ring",
            "--starting-port", str(free_port())]
TOKENS = 64
SEEDS = [0]
KNOBS = {"llama": [(2, 3, 2), (4, 5, 1), (8, 7, 4)], "qwen3": [(1, 2, 2), (3, 4, 1), (8, 6, 2)]}


def launch(command: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    run = subprocess.run(launcher() + ["--"] + command, capture_output=True, text=True, timeout=timeout, env=env,
                         cwd=cwd, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def cases(family: str) -> list:
    """(mode, κ, γ, ℓe, opening): opening i under setting i mod 3, mirror and sd by turns, so every setting runs
    both modes; with MIRROR_MLX_DIST_FULL=1, every opening under every setting in both modes (48 runs: give
    pytest --timeout 1800)."""
    knobs = KNOBS[family]
    if os.environ.get("MIRROR_MLX_DIST_FULL") == "1":
        return [(mode, *k, i) for k in knobs for mode in ("mirror", "sd") for i in range(8)]
    return [("mirror" if i % 2 == 0 else "sd", *knobs[i % 3], i) for i in range(8)]


def qwen3_pair(tmp: Path) -> tuple[Path, Path]:
    """A tiny random 3-layer qwen3 target with the demo tokenizer, and a draft: the target's weights plus
    noise (right often, not always)."""
    config = dict(CONFIGS["qwen3"], vocab_size=512, num_hidden_layers=3)
    folders = []
    for name, noise in (("qwen3-target", 0.0), ("qwen3-draft", 0.3)):
        model = tiny_model("qwen3", seed=21, **{k: config[k] for k in ("vocab_size", "num_hidden_layers")})
        folder = tmp / name
        folder.mkdir()
        for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
            shutil.copy(TARGET / f, folder / f)
        if noise:
            mx.random.seed(5)
            model.update(tree_map(lambda a: a + noise * a.std() * mx.random.normal(a.shape), model.parameters()))
        save_model(folder, model)
        save_config(config, folder / "config.json")
        folders.append(folder)
    return folders[0], folders[1]


def across(family: str, tmp: Path) -> tuple:
    """One family's cases on 2 ranks, in one launcher run: rank 0's results (checked equal to rank 1's), and
    the single-process model, tokenizer and prompt ids."""
    if family == "llama":
        target, draft, openings = TARGET, DRAFT, tinystories()[:8]
    else:
        (target, draft), openings = qwen3_pair(tmp), tinystories()[8:16]
    model, tokenizer = load(str(target))
    prompts = [tokenizer.encode(p.text) for p in openings]
    spec = {family: dict(target=str(target), draft=str(draft), prompts=prompts, tokens=TOKENS, cases=cases(family),
                         seeded=SEEDS, unseeded=family == "llama")}
    (tmp / "spec.json").write_text(json.dumps(spec))
    launch([sys.executable, str(ROOT / "tests" / "distributed_run.py"), str(tmp / "spec.json"), str(tmp)], tmp)
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["all_sum"] == ranks[1]["all_sum"]  # the ring's sum is the same bits on every rank
    a, b = ranks[0][family], ranks[1][family]
    assert a["greedy"] == b["greedy"], f"{family}: the ranks committed different tokens"
    assert a["seeded"] == b["seeded"] and a.get("unseeded") == b.get("unseeded"), family
    return a, model, tokenizer, prompts


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sharded_target_mirror_and_sd_equal_mlx_lm_greedy_and_one_process_seeded_sample(tmp_path, family):
    got, model, tokenizer, prompts = across(family, tmp_path)
    for (mode, kappa, gamma, exit_layer, i), out, stats in zip(cases(family), got["greedy"], got["stats"]):
        assert stats[0] == mode and stats[1] is None, stats
        ref = [t for t, _ in generate_step(mx.array(prompts[i]), model, max_tokens=TOKENS)]
        assert out == ref, f"{family} {mode} κ={kappa} γ={gamma} ℓe={exit_layer}, opening {i}: {out}, mlx-lm {ref}"
    assert sum(s[2] for s in got["stats"]) > 0 and any(s[3] for s in got["stats"])  # right at times, wrong at times
    pipe = Pipeline(model, tokenizer)  # one process, the target alone: a seed gives the same tokens in every mode
    try:
        for seed, out in got["seeded"].items():
            ref = pipe.generate(prompts[0], max_tokens=TOKENS, mode="ar", temperature=0.8, seed=int(seed),
                                stop=False).tokens
            assert out == ref, f"{family} seed {seed}: {out}, one process samples {ref}"
    finally:
        pipe.close()


def descendants(pid: int) -> list[int]:
    """Every process under `pid` now (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def rank_pid(pids: list[int], rank: int) -> int:
    for pid in pids:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"MLX_RANK={rank}".encode() in env and b"generate" in cmd and b"ane_draft" not in cmd:
            return pid
    raise AssertionError(f"no rank {rank} among {pids}")


def started_generating(tmp: Path, tokens: int = 400, **env: str) -> subprocess.Popen:
    """`mirror-mlx generate` of the demo pair on 2 ranks, once rank 0 has printed its first text."""
    import select

    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT), MIRROR_MLX_TRACE_SHM="1", **env)
    command = [sys.executable, "-m", "mirror_mlx", "generate", "--max-tokens", str(tokens), "--mode", "mirror",
               "--kappa", "4", "--gamma", "3", "--exit-layer", "2"]
    proc = subprocess.Popen(launcher() + ["--"] + command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, env=env, text=True, cwd=tmp, start_new_session=True,
                            # a runner that started us in the background ignores SIGINT; Ctrl-C needs it back
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    if not select.select([proc.stdout], [], [], 180)[0]:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("no text from rank 0 in 180 s")
    return proc


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks through /proc")
@pytest.mark.parametrize("how", ["rank 1 killed", "rank 1 stalled", "Ctrl-C"])
def test_a_rank_lost_or_stalled_or_ctrl_c_ends_every_rank_leaving_no_process_and_no_segment(tmp_path, how):
    proc = started_generating(tmp_path, MIRROR_MLX_DIST_TIMEOUT="10")
    procs = descendants(proc.pid)
    t0 = time.monotonic()
    try:
        rank0, rank1 = rank_pid(procs, 0), rank_pid(procs, 1)
        if how == "Ctrl-C":  # as a terminal sends it: to the launcher's whole process group
            os.killpg(proc.pid, signal.SIGINT)
        elif how == "rank 1 killed":
            os.kill(rank1, signal.SIGKILL)
        else:  # alive but silent: rank 0's watchdog ends it, then rank 1 (resumed) ends on its own
            os.kill(rank1, signal.SIGSTOP)
            while alive(rank0) and time.monotonic() - t0 < 30:
                time.sleep(0.1)
            os.kill(rank1, signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
    assert time.monotonic() - t0 < 30, err  # (mlx.launch itself exits 0 when it stopped the ranks)
    if how == "Ctrl-C":  # each rank ends as one process does on Ctrl-C (130), or on its lost peer (one line)
        assert "rank 0 exited with code" in err and "rank 1 exited with code" in err, err
        assert "Traceback" not in err.split("KeyboardInterrupt")[-1], err  # (mlx.launch's own comes first)
    else:  # rank 0 ends on the lost peer, the launcher's SIGTERM or its watchdog, whichever comes first: one line
        said = [line for line in err.splitlines() if line.startswith("mirror-mlx: rank 0: ")]
        assert len(said) == 1, err
        if how == "rank 1 stalled":
            assert "no answer from the other ranks in 10 s" in said[0], err
    deadline = time.monotonic() + 10
    while (left := [p for p in procs if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"still running: {left}"
    made = made_in(err)
    assert made and not wait_unlinked(made), err


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the draft host through /proc")
def test_a_draft_host_that_dies_is_dropped_on_every_rank_and_the_text_is_still_the_targets(tmp_path):
    import mirror_mlx

    proc = started_generating(tmp_path, tokens=120)
    host = next(p for p in descendants(proc.pid) if b"ane_draft.host" in Path(f"/proc/{p}/cmdline").read_bytes())
    os.kill(host, signal.SIGKILL)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "continuing with the target alone" in err and "exited with code" not in err, err
    pipe = mirror_mlx.load()
    try:
        ref = pipe.generate("Once upon a time", max_tokens=120, mode="ar").text
    finally:
        pipe.close()
    assert out.strip() == ref.strip()
    made = made_in(err)
    assert made and not wait_unlinked(made), err
