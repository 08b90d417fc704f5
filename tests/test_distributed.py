"""Across Macs, on loopback: the target sharded over 2 ranks of the ring backend, the draft beside rank 0.
Greedy mirror and sd return mlx-lm's single-process greedy tokens, token for token, for a llama (the demo
pair) and a qwen3 (tiny random weights) split tensor-parallel, and a qwen2 split by layers (mlx-lm's
pipeline split, ℓe on either rank's stage), 8 openings × 64 tokens under 3 (κ, γ, ℓe) settings each; a
seeded sample equals the single-process one; both ranks commit the same tokens. Under `mlx.launch` itself,
a rank killed or stalled mid-generation, or Ctrl-C on the launcher, ends the run with one line, no process
and no shared memory left.

Each family is one run of 2 ranks set up as mlx.launch sets them up, without its launcher process
(mirror_mlx/bench/ranks.py: it keeps a core busy); tests/distributed_run.py runs every case on every rank.
The ring's collectives cost milliseconds each on a loaded 2-core box (ten per forward of the demo target), so
each opening runs once, under one of the 3 settings, in mirror or sd by turns; MIRROR_MLX_DIST_FULL=1 runs
every opening under every setting in both modes.
"""

import json
import re
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
from mlx_lm.utils import load, save_config, save_model

from mirror_mlx.bench.ranks import run_ranks
from mirror_mlx.demo import DRAFT, TARGET
from mirror_mlx.pipeline import Pipeline
from mirror_mlx.prompts import tinystories
from tests.leaks import made_in, wait_unlinked
from tests.models import CONFIGS, tiny_model
from tests.support import assert_lossless, reference_greedy
from tests.support.processes import alive, descendants
from tests.support.ranks import ROOT, launched, renice

pytestmark = pytest.mark.usefixtures("one_group_at_a_time")  # (conftest.py: one group of ranks at a time)

TOKENS = 64
SEEDS = [0]
KNOBS = {"llama": [(2, 3, 2), (4, 5, 1), (8, 7, 4)], "qwen3": [(1, 2, 2), (3, 4, 1), (8, 6, 2)],
         "qwen2": [(2, 3, 1), (4, 4, 3), (8, 6, 2)]}  # qwen2 split by layers: rank 1 runs blocks 1-2, rank 0 blocks 3-4
SPLIT = {"llama": "tensor", "qwen3": "tensor", "qwen2": "pipeline"}


def launch(command: list[str], cwd: Path, timeout: float = 600) -> list:
    """2 ranks of the ring backend on loopback, as mlx.launch sets them up, without its launcher process (it
    keeps a core busy: mirror_mlx/bench/ranks.py); the signal tests below run mlx.launch itself."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    ranks = run_ranks(command, 2, timeout, env, cwd)
    for r, got in enumerate(ranks):
        assert got.returncode == 0, f"rank {r}: {got.stderr[-3000:]}"
    return ranks


def cases(family: str) -> list:
    """(mode, κ, γ, ℓe, opening): opening i under setting i mod 3, mirror and sd by turns, so every setting runs
    both modes; with MIRROR_MLX_DIST_FULL=1, every opening under every setting in both modes (48 runs: give
    pytest --timeout 1800)."""
    knobs = KNOBS[family]
    if os.environ.get("MIRROR_MLX_DIST_FULL") == "1":
        return [(mode, *k, i) for k in knobs for mode in ("mirror", "sd") for i in range(8)]
    return [("mirror" if i % 2 == 0 else "sd", *knobs[i % 3], i) for i in range(8)]


def tiny_pair(tmp: Path, family: str, layers: int, vocab: int = 512) -> tuple[Path, Path]:
    """A tiny random target of `family` with the demo tokenizer, and a draft: the target's weights plus
    noise (right often, not always)."""
    config = dict(CONFIGS[family], vocab_size=vocab, num_hidden_layers=layers)
    folders = []
    for name, noise in ((f"{family}-target", 0.0), (f"{family}-draft", 0.3)):
        model = tiny_model(family, seed=21, **{k: config[k] for k in ("vocab_size", "num_hidden_layers")})
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
    elif family == "qwen3":
        (target, draft), openings = tiny_pair(tmp, "qwen3", 3), tinystories()[8:16]
    else:
        (target, draft), openings = tiny_pair(tmp, "qwen2", 4, 513), tinystories()[16:24]  # (mlx-lm adds <|endoftext|> to a qwen2 tokenizer)
    model, tokenizer = load(str(target))
    prompts = [tokenizer.encode(p.text) for p in openings]
    spec = {family: dict(target=str(target), draft=str(draft), prompts=prompts, tokens=TOKENS, cases=cases(family),
                         seeded=SEEDS, unseeded=family == "llama", pipeline=SPLIT[family] == "pipeline")}
    (tmp / "spec.json").write_text(json.dumps(spec))
    launch([sys.executable, str(ROOT / "tests" / "distributed_run.py"), str(tmp / "spec.json"), str(tmp)], tmp)
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["all_sum"] == ranks[1]["all_sum"]  # the ring's sum is the same bits on every rank
    a, b = ranks[0][family], ranks[1][family]
    assert a["greedy"] == b["greedy"], f"{family}: the ranks committed different tokens"
    assert a["seeded"] == b["seeded"] and a.get("unseeded") == b.get("unseeded"), family
    assert a["split"] == SPLIT[family], a["split"]
    return a, model, tokenizer, prompts


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
def test_sharded_target_mirror_and_sd_equal_mlx_lm_greedy_and_one_process_seeded_sample(tmp_path, family):
    got, model, tokenizer, prompts = across(family, tmp_path)
    for (mode, kappa, gamma, exit_layer, i), out, stats in zip(cases(family), got["greedy"], got["stats"]):
        assert stats[0] == mode and stats[1] is None, stats
        ref = reference_greedy(model, prompts[i], TOKENS)
        assert_lossless(out, ref, f"{family} {mode} κ={kappa} γ={gamma} ℓe={exit_layer}, opening {i}: {out}, "
                                  f"mlx-lm {ref}")
    assert sum(s[2] for s in got["stats"]) > 0 and any(s[3] for s in got["stats"])  # right at times, wrong at times
    pipe = Pipeline(model, tokenizer)  # one process, the target alone: a seed gives the same tokens in every mode
    try:
        for seed, out in got["seeded"].items():
            ref = pipe.generate(prompts[0], max_tokens=TOKENS, mode="ar", temperature=0.8, seed=int(seed),
                                stop=False).tokens
            assert_lossless(out, ref, f"{family} seed {seed}: {out}, one process samples {ref}")
    finally:
        pipe.close()


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

    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT), MIRROR_MLX_TRACE_SHM="1",
               TMPDIR=str(tmp), **env)  # (mlx.launch leaves 2 mktemp files a rank: its pid file, the hostfile)
    command = [sys.executable, "-m", "mirror_mlx", "generate", "--max-tokens", str(tokens), "--mode", "mirror",
               "--kappa", "4", "--gamma", "3", "--exit-layer", "2"]
    proc = launched(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True, cwd=tmp)
    if not select.select([proc.stdout], [], [], 180)[0]:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("no text from rank 0 in 180 s")
    try:  # readable at its end too: a launcher that exited at once says why
        code = proc.wait(timeout=0.2)
    except subprocess.TimeoutExpired:
        return proc
    raise AssertionError(f"the launcher exited ({code}) before rank 0 printed: {proc.stderr.read()[-3000:]}")


WATCHDOG_S = 25  # MIRROR_MLX_DIST_TIMEOUT below: the stalled rank is ended after it. It times every wait, rank 0's start
# too (its draft host, the prefill, the first rollout), which at load 9 on 2 cores took over 10 s
ENDS_WITHIN_S = WATCHDOG_S + 20  # every rank gone after the fault (Ctrl-C: within faults.GRACE_S)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks through /proc")
@pytest.mark.parametrize("how", ["rank 1 killed", "rank 1 stalled", "Ctrl-C"])
def test_a_rank_lost_or_stalled_or_ctrl_c_ends_every_rank_leaving_no_process_and_no_segment(tmp_path, how):
    proc = started_generating(tmp_path, MIRROR_MLX_DIST_TIMEOUT=str(WATCHDOG_S))
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
            renice(rank0, 10)  # it only waits now, and its wait spins in the ring backend: on time others spare
            while alive(rank0) and time.monotonic() - t0 < WATCHDOG_S + 20:
                time.sleep(0.1)
            os.kill(rank1, signal.SIGCONT)
        out, err = proc.communicate(timeout=ENDS_WITHIN_S + 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
    assert time.monotonic() - t0 < ENDS_WITHIN_S, err  # (mlx.launch itself exits 0 when it stopped the ranks)
    if how == "Ctrl-C":  # each rank ends as one process does on Ctrl-C (130), or on its lost peer (one line)
        assert "rank 0 exited with code" in err and "rank 1 exited with code" in err, err
        assert "Traceback" not in err.split("KeyboardInterrupt")[-1], err  # (mlx.launch's own comes first)
    else:  # rank 0 ends on the lost peer, the launcher's SIGTERM or its watchdog, whichever comes first: one line
        # (mlx.launch relays the ranks' stderr in pieces: its own [WARN] can share a line with rank 0's)
        said = re.findall(r"mirror-mlx: rank 0: [^\n]*", err)
        assert len(said) == 1, err
        if how == "rank 1 stalled":
            assert f"no answer from the other ranks in {WATCHDOG_S} s" in said[0], err
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
    host = next(p for p in descendants(proc.pid) if b"drafts.host" in Path(f"/proc/{p}/cmdline").read_bytes())
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


@pytest.mark.parametrize("branches", [None, 3])
def test_generate_with_pipeline_splits_by_layers_and_prints_mlx_lm_s_greedy_text(tmp_path, branches):
    """`--pipeline` on the command line: the qwen2 pair split by layers (rank 1's stage holds ℓe = 2), mirror on
    2 ranks; the same tokens as mlx-lm's one process. In one process the flag is said to be ignored. With a
    branch budget (`--branches 3` of 8) every rank scores the branches from the exit rank's shared probabilities."""
    target, draft = tiny_pair(tmp_path, "qwen2", 4, 513)
    model, tokenizer = load(str(target))
    prompt = tinystories()[24].text
    command = [sys.executable, "-m", "mirror_mlx", "generate", "--model", str(target), "--draft-model", str(draft),
               "--exit-adapter", "none", "--mode", "mirror", "--kappa", "2", "--gamma", "3", "--exit-layer", "2",
               "--max-tokens", "32", "--json", "--prompt", prompt, "--pipeline"]
    command += ["--branches", str(branches)] if branches is not None else []
    got = json.loads(launch(command, tmp_path)[0].stdout)
    assert got["stats"]["branches"] == branches
    assert got["stats"]["branches_rolled"] <= (branches or 2 * (3 + 1)) * got["stats"]["steps"]
    ids = tokenizer.encode(prompt)
    ref = reference_greedy(model, ids, 32)
    eos = next((i for i, t in enumerate(ref) if t in tokenizer.eos_token_ids), len(ref))
    assert_lossless(got["tokens"], ref[:eos + 1][:32], got)
    assert got["stats"]["mode"] == "mirror", got
    one = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert one.returncode == 0 and "nothing to split: ignored" in one.stderr, one.stderr
    assert json.loads(one.stdout)["tokens"] == got["tokens"]
