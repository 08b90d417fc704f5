"""`mirror-mlx bench`: Mirror-SD against what users would run instead, in one process (DESIGN §7).

Why it is built this way:
- every mode runs on the same prompts, interleaved per prompt (the order rotates), after a warm-up,
  so drift on a shared machine hits all modes alike;
- `ar` and `mlx_sd` are mlx-lm's own `generate_step` / `speculative_generate_step` (baselines.py),
  and mlx_sd gets its best num_draft_tokens on this machine, so the comparison is the fair one;
- at temperature 0 every mode's tokens must equal `ar`'s: a speedup that computes something else
  is no speedup, so a mismatch stops the run (`Mismatch`) and names the prompt;
- prefill is off the clock for every mode (the draft's too), as in mlx-lm's own generation_tps.
`--sweep` runs a grid of (κ, γ, ℓ_e) in mirror mode against `ar` instead of the mode comparison.
"""

import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from itertools import product
from pathlib import Path
from statistics import median
from typing import Any, Optional, Sequence

import mlx.core as mx

from . import __version__
from .baselines import best_mlx_sd, run_ar, run_mlx_sd
from .engine import DecodeOptions
from .prompts import load_prompts

MODES = ("mirror", "sd", "mlx_sd", "ar", "auto")
ENGINE_MODES = ("mirror", "sd", "auto")  # auto: the tuned mode and knobs (mirror_mlx.tune), chosen at warm-up
SD_KS = (2, 3, 4, 5, 6)


class Mismatch(RuntimeError):
    """A mode's greedy tokens differ from mlx-lm's generate_step: the run is invalid."""


@dataclass
class BenchConfig:
    model: Optional[str] = None  # None: the embedded demo pair
    draft_model: Optional[str] = None
    exit_adapter: Optional[str] = None
    prompts: str = "tinystories"
    limit: Optional[int] = 10
    skip: int = 0  # leave out the first `skip` prompts (e.g. those a sweep chose the knobs on)
    max_tokens: int = 64
    modes: Sequence[str] = MODES
    temp: float = 0.0
    kappa: int = 8
    gamma: int = 7
    exit_layer: Optional[int] = None
    out: Path = Path("bench_out")
    sweep: Optional[str] = None
    seed: int = 0
    sd_ks: Sequence[int] = SD_KS
    sd_sweep_prompts: int = 2  # mlx_sd's num_draft_tokens is chosen on this many first prompts
    warmup_tokens: int = 16
    pin: bool = False
    progress: bool = True


@dataclass
class Sample:
    """One generation: one prompt, one mode (or sweep point)."""

    mode: str
    prompt: int
    category: str
    tokens: list[int]
    decode_s: float
    target_forwards: int
    peak_memory_gb: float
    steps: int = 0
    prefix_s: float = 0.0
    suffix_s: float = 0.0  # mirror: target suffix; sd: the whole verify forward
    draft_s: float = 0.0
    hidden_s: float = 0.0
    reuses: int = 0
    fallbacks: int = 0
    omega_sum: float = 0.0
    num_draft_tokens: Optional[int] = None
    ran_as: Optional[str] = None  # the engine's mode when it differs (a dropped draft runs as ar)
    timeline: list = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s else 0.0

    @property
    def rollout_s(self) -> float:
        """Mirror: time in branch rollouts (the rest of draft_s is serial: first and fallback windows)."""
        return sum(t["rollout"][1] - t["rollout"][0] for t in self.timeline)

    @property
    def rollout_wait_s(self) -> float:
        """Mirror: how long the target waited for branch rollouts that outlasted its suffix."""
        return sum(max(0.0, t["rollout"][1] - max(t["rollout"][0], t["suffix"][1])) for t in self.timeline)


@dataclass
class PromptIds:
    category: str
    text: str
    ids: list[int]
    truncated: bool


# --- parsing -----------------------------------------------------------------------------------------

def parse_modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {', '.join(bad) or '(none)'}: choose from {','.join(MODES)}")
    return modes


def layer_value(text: str, n_layers: int) -> int:
    """An exit layer: an integer, or an expression in N (the target's layers) like N/2 or 3N/4."""
    text = text.strip().replace(" ", "")
    if text.isdigit():
        return int(text)
    m = re.fullmatch(r"(\d*)N(?:/(\d+))?", text)
    if not m:
        raise ValueError(f"exit layer {text!r} is neither an integer nor like N/4, N/2, 3N/4")
    return max(1, int(m.group(1) or 1) * n_layers // int(m.group(2) or 1))


def parse_sweep(spec: str, n_layers: int, kappa: int, gamma: int, exit_layer: int) -> dict[str, list[int]]:
    """'kappa=1,4 gamma=3,5 exit=N/4,N/2' → value lists; a knob left out keeps its single value."""
    grid = {"kappa": [kappa], "gamma": [gamma], "exit": [exit_layer]}
    for part in spec.split():
        key, _, values = part.partition("=")
        if key not in grid or not values:
            raise ValueError(f"sweep part {part!r} is not kappa=..., gamma=... or exit=...")
        vals = [layer_value(v, n_layers) if key == "exit" else int(v) for v in values.split(",") if v]
        grid[key] = sorted(set(vals))
    return grid


# --- machine -----------------------------------------------------------------------------------------

def machine() -> dict:
    """What the numbers depend on: CPU, cores, load, versions, BLAS threads."""
    import mlx_lm

    from .blas import status

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except Exception:
        commit = ""
    return {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(),
            "cpus_allowed": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "python": platform.python_version(), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "mirror_mlx": __version__, "commit": commit, "blas": status(),
            "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
            "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None}


def _tids() -> list[int]:
    return sorted(int(t) for t in os.listdir("/proc/self/task"))


def pin_threads(pipe: Any) -> dict:
    """Target side (and mlx-lm baselines) on one core, the draft worker on another.

    MLX starts one CPU thread per stream on its first task, from the thread that submits it, and a
    new thread inherits its creator's affinity. So: pin every thread alive now (main, the default
    stream, the target worker) to core A, then the draft worker's thread to core B before it runs
    anything; its stream thread, born later from it, lands on B. With OPENBLAS_NUM_THREADS=1 no
    other compute threads exist. `thread_report` shows afterwards where CPU time went.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {"pinned": False, "why": f"only {len(cpus)} CPU allowed"}
    a, b = cpus[0], cpus[1]
    for tid in _tids():
        os.sched_setaffinity(tid, {a})
    out = {"pinned": True, "target_cpu": a, "draft_cpu": b, "main_tid": threading.get_native_id(),
           "target_worker_tid": pipe.engine.target_worker.call(threading.get_native_id)}
    if pipe.engine.draft_worker is not None:
        pipe.engine.draft_worker.call(os.sched_setaffinity, 0, {b})
        out["draft_worker_tid"] = pipe.engine.draft_worker.call(threading.get_native_id)
    return out


def thread_report() -> list[dict]:
    """Every thread of this process: allowed CPUs and CPU seconds used."""
    out, tick = [], os.sysconf("SC_CLK_TCK")
    for tid in _tids():
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            status = Path(f"/proc/self/task/{tid}/status").read_text()
        except OSError:
            continue
        allowed = re.search(r"Cpus_allowed_list:\s*(\S+)", status)
        out.append({"tid": tid, "cpus": allowed.group(1) if allowed else "?",
                    "cpu_s": round((int(stat[11]) + int(stat[12])) / tick, 2)})
    return out


# --- running -----------------------------------------------------------------------------------------

def select_prompts(cfg: BenchConfig, pipe: Any) -> list[PromptIds]:
    """The prompts as token ids, cut to fit the target's context with max_tokens to spare."""
    limit = None if cfg.limit is None else cfg.skip + cfg.limit
    chosen = load_prompts(cfg.prompts, limit)[cfg.skip :]
    if not chosen:
        raise ValueError(f"no prompts left after skipping {cfg.skip}")
    room = None
    if pipe.engine.context_length:
        room = pipe.engine.context_length - cfg.max_tokens
        if room < 2:
            raise ValueError(f"max_tokens {cfg.max_tokens} leaves no room for a prompt in the target's "
                             f"context of {pipe.engine.context_length} tokens: lower --max-tokens")
    out = []
    for p in chosen:
        ids = pipe.encode(p.text)
        cut = room is not None and len(ids) > room
        out.append(PromptIds(p.category, p.text, ids[:room] if cut else ids, cut))
    return out


def run_engine(pipe: Any, mode: str, p: PromptIds, index: int, max_tokens: int, temp: float, seed: int,
               kappa: int, gamma: int, exit_layer: Optional[int]) -> Sample:
    """`mirror` or `sd` through the Pipeline (stop=False: exactly max_tokens, as the baselines)."""
    r = pipe.generate(p.ids, max_tokens=max_tokens, temperature=temp, seed=seed, kappa=kappa, gamma=gamma,
                      exit_layer=exit_layer, mode=mode, stop=False)
    s = r.stats
    t0 = s.timeline[0]["prefix"][0] if s.timeline else 0.0
    timeline = [{k: (v[0] - t0, v[1] - t0) if isinstance(v, tuple) else v for k, v in step.items()}
                for step in s.timeline]
    return Sample(mode, index, p.category, list(r.tokens), s.decode_seconds, s.target_forwards, s.peak_memory_gb,
                  s.steps, s.prefix_seconds, s.suffix_seconds, s.draft_seconds, s.hidden_draft_seconds, s.reuses,
                  s.fallbacks, s.omega_sum, ran_as=s.mode if s.mode != mode else None, timeline=timeline)


def run_baseline(pipe: Any, mode: str, p: PromptIds, index: int, max_tokens: int, temp: float, seed: int,
                 k: Optional[int] = None) -> Sample:
    """`ar` (generate_step) or `mlx_sd` (speculative_generate_step with k draft tokens)."""
    if mode == "ar":
        run = run_ar(pipe.model, p.ids, max_tokens, temp, seed=seed)
    else:
        run = run_mlx_sd(pipe.model, mlx_draft(pipe), p.ids, max_tokens, k, temp, seed=seed)
    return Sample(mode, index, p.category, list(run.tokens), run.decode_s, run.target_forwards,
                  run.peak_memory / 1e9, run.target_forwards, num_draft_tokens=k)


def mlx_draft(pipe: Any) -> Any:
    model = getattr(pipe.draft, "model", None)
    if model is None or not hasattr(model, "layers"):
        raise ValueError("mode mlx_sd needs a plain mlx-lm draft model (mlx-lm cannot drive this draft): "
                         "drop mlx_sd from --modes or pass an mlx-lm model folder as --draft-model")
    return model


def check_equal(samples: Sequence[Sample], ref: Sample, p: PromptIds, what: str = "mode") -> None:
    """Raise Mismatch naming the prompt unless every sample's tokens equal `ref`'s (mlx-lm greedy)."""
    for s in samples:
        if s.tokens != ref.tokens:
            at = next((i for i, (a, b) in enumerate(zip(s.tokens, ref.tokens)) if a != b),
                      min(len(s.tokens), len(ref.tokens)))
            text = p.text if len(p.text) <= 70 else p.text[:67] + "..."
            raise Mismatch(f"{what} {s.mode} differs from ar (mlx-lm generate_step) at temperature 0 on prompt "
                           f"#{s.prompt} [{p.category}] {text!r}: first difference at token {at} "
                           f"({s.tokens[at:at + 4]} vs {ref.tokens[at:at + 4]})")


def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def run_modes(cfg: BenchConfig, pipe: Any, prompts: list[PromptIds], result: dict) -> None:
    """The mode comparison: warm-up, mlx_sd's k sweep, then every mode on every prompt, interleaved."""
    modes = list(cfg.modes)
    if "ar" not in modes:  # ar is the reference for the equality check and the speedups
        modes.append("ar")
    exit_layer = pipe.engine.exit_layer(DecodeOptions(exit_layer=cfg.exit_layer))  # an adapter's layer, else N/2
    knobs = dict(kappa=cfg.kappa, gamma=cfg.gamma, exit_layer=exit_layer)
    sd_prompts = prompts[: max(1, cfg.sd_sweep_prompts)]
    bar = progress_bar(len(modes) + len(prompts) * len(modes) +
                       ("mlx_sd" in modes) * len(cfg.sd_ks) * len(sd_prompts), "bench", cfg.progress)
    result.update(modes=modes, knobs=knobs, mlx_sd_sweep=None)
    try:
        first = prompts[0]
        for mode in modes:  # warm-up: allocations, lazy MLX stream threads, the exit tap
            bar.set_postfix_str(f"warm-up {mode}")
            one(pipe, mode, first, 0, cfg, knobs, cfg.warmup_tokens, k=cfg.sd_ks[0])
            bar.update()
        k_best = None
        if "mlx_sd" in modes:
            bar.set_postfix_str("mlx_sd num_draft_tokens sweep")
            sweep = best_mlx_sd(pipe.model, mlx_draft(pipe), [p.ids for p in sd_prompts], cfg.max_tokens,
                                ks=tuple(cfg.sd_ks), temp=cfg.temp, seed=cfg.seed, warmup=False)
            bar.update(len(cfg.sd_ks) * len(sd_prompts))
            k_best = sweep.best_k
            result["mlx_sd_sweep"] = {"prompts": len(sd_prompts), "best_k": k_best,
                                      "tokens_per_s": {str(k): v for k, v in sweep.tokens_per_s.items()}}
        for i, p in enumerate(prompts):
            order = modes[i % len(modes):] + modes[: i % len(modes)]
            done = {}
            for mode in order:
                bar.set_postfix_str(f"prompt {i + 1}/{len(prompts)} {mode}")
                done[mode] = one(pipe, mode, p, i, cfg, knobs, cfg.max_tokens, k=k_best)
                bar.update()
            result["samples"].extend(done[m] for m in modes)
            if cfg.temp == 0:
                check_equal([done[m] for m in modes if m != "ar"], done["ar"], p)
    finally:
        bar.close()
    result["equality_checked"] = cfg.temp == 0


def one(pipe: Any, mode: str, p: PromptIds, index: int, cfg: BenchConfig, knobs: dict, max_tokens: int,
        k: Optional[int] = None) -> Sample:
    seed = cfg.seed + index
    if mode in ENGINE_MODES:
        if mode == "auto":  # the profile's knobs, not the command line's
            knobs = dict(kappa=None, gamma=None, exit_layer=None)
        return run_engine(pipe, mode, p, index, max_tokens, cfg.temp, seed, **knobs)
    return run_baseline(pipe, mode, p, index, max_tokens, cfg.temp, seed, k if mode == "mlx_sd" else None)


def run_sweep(cfg: BenchConfig, pipe: Any, prompts: list[PromptIds], result: dict) -> None:
    """Mirror mode over the (κ, γ, ℓ_e) grid, with `ar` on each prompt as reference and baseline."""
    default_exit = pipe.engine.exit_layer(DecodeOptions(exit_layer=cfg.exit_layer))  # an adapter's layer, else N/2
    grid = parse_sweep(cfg.sweep, pipe.engine.n_layers, cfg.kappa, cfg.gamma, default_exit)
    points = [dict(kappa=k, gamma=g, exit_layer=e) for e, g, k in product(grid["exit"], grid["gamma"], grid["kappa"])]
    bar = progress_bar(2 + len(prompts) * (len(points) + 2), "sweep", cfg.progress)
    result.update(grid=grid, points=points)
    try:
        for mode in ("ar", "mirror"):
            one(pipe, mode, prompts[0], 0, cfg, points[0], cfg.warmup_tokens)
            bar.update()
        for i, p in enumerate(prompts):
            ref = one(pipe, "ar", p, i, cfg, points[0], cfg.max_tokens)
            bar.update()
            result["samples"].append(ref)
            for pt in points if i % 2 == 0 else points[::-1]:  # alternate directions: linear drift cancels
                bar.set_postfix_str(f"prompt {i + 1}/{len(prompts)} {point_name(pt)}")
                s = one(pipe, "mirror", p, i, cfg, pt, cfg.max_tokens)
                s.mode = point_name(pt)
                result["samples"].append(s)
                bar.update()
                if cfg.temp == 0:
                    check_equal([s], ref, p, what="sweep point")
            result["samples"].append(one(pipe, "ar", p, i, cfg, points[0], cfg.max_tokens))  # ar at both ends
            bar.update()
    finally:
        bar.close()
    result["equality_checked"] = cfg.temp == 0


def point_name(pt: dict) -> str:
    return f"k{pt['kappa']}-g{pt['gamma']}-e{pt['exit_layer']}"


# --- summaries ---------------------------------------------------------------------------------------

def summarize(samples: Sequence[Sample]) -> dict:
    """Median tokens/s; pooled rates (sums over prompts) and the per-step latency breakdown in ms."""
    n_tok = sum(len(s.tokens) for s in samples)
    fwd = sum(s.target_forwards for s in samples)
    steps = sum(s.steps for s in samples)
    decode = sum(s.decode_s for s in samples)
    prefix, suffix = sum(s.prefix_s for s in samples), sum(s.suffix_s for s in samples)
    draft, hidden = sum(s.draft_s for s in samples), sum(s.hidden_s for s in samples)
    engine = any(s.suffix_s for s in samples)
    per = 1000.0 / max(steps, 1)
    out = {"prompts": len(samples), "tokens": n_tok, "tokens_per_s": median(s.tokens_per_s for s in samples),
           "mean_accepted": n_tok / max(fwd, 1), "ms_per_step": decode * per,
           "peak_memory_gb": max(s.peak_memory_gb for s in samples),
           "fallback_rate": None, "reuse_rate": None, "omega_kappa": None, "hidden_draft_fraction": None}
    if engine:  # the critical path of a step, in order; the hidden draft time runs beside the suffix
        wait = sum(s.rollout_wait_s for s in samples)
        serial = draft - sum(s.rollout_s for s in samples)
        out["breakdown_ms"] = {"prefix": prefix * per, "suffix": suffix * per, "rollout_wait": wait * per,
                               "draft": serial * per,
                               "overhead": max(0.0, decode - prefix - suffix - wait - serial) * per,
                               "draft_hidden": hidden * per}
    else:  # mlx-lm's loops: one number per step, not split
        out["breakdown_ms"] = {"unsplit": decode * per}
    if any(s.prefix_s for s in samples):  # mirror: only it has a target prefix
        out.update(fallback_rate=sum(s.fallbacks for s in samples) / max(steps, 1),
                   reuse_rate=sum(s.reuses for s in samples) / max(steps, 1),
                   omega_kappa=sum(s.omega_sum for s in samples) / max(steps, 1),
                   hidden_draft_fraction=hidden / draft if draft else 0.0)
    k = {s.num_draft_tokens for s in samples if s.num_draft_tokens}
    if k:
        out["num_draft_tokens"] = sorted(k)
    dropped = sorted({s.ran_as for s in samples if s.ran_as})
    if dropped:
        out["ran_as"] = dropped
    return out


def table(samples: Sequence[Sample], keys: Sequence[str]) -> dict:
    """{category: {key: summary}} with an `all` category first; speedups against `ar` and `mlx_sd`."""
    cats = ["all"] + sorted({s.category for s in samples})
    if len(cats) == 2:
        cats = ["all"]
    out: dict = {}
    for cat in cats:
        rows = {}
        for key in keys:
            group = [s for s in samples if s.mode == key and (cat == "all" or s.category == cat)]
            if group:
                rows[key] = summarize(group)
        for key, row in rows.items():
            for base in ("ar", "mlx_sd"):
                b = rows.get(base)
                row[f"speedup_vs_{base}"] = row["tokens_per_s"] / b["tokens_per_s"] if b and b["tokens_per_s"] else None
                row[f"paired_speedup_vs_{base}"] = paired_speedup(
                    [s for s in samples if cat == "all" or s.category == cat], key, base) if b else None
        out[cat] = rows
    return out


def paired_speedup(samples: Sequence[Sample], key: str, base: str) -> Optional[float]:
    """Median over prompts of key's tokens/s ÷ base's on the same prompt (run next to it, so drift cancels)."""
    def per_prompt(mode: str) -> dict[int, float]:
        runs: dict[int, list[float]] = {}
        for s in samples:
            if s.mode == mode:
                runs.setdefault(s.prompt, []).append(s.tokens_per_s)
        return {p: sum(v) / len(v) for p, v in runs.items()}

    a, b = per_prompt(key), per_prompt(base)
    ratios = [a[p] / b[p] for p in a if b.get(p)]
    return median(ratios) if ratios else None


def best_point(rows: dict, points: Sequence[dict]) -> dict:
    """The sweep point with the highest median tokens/s (its knobs and its row)."""
    pt = max(points, key=lambda pt: rows[point_name(pt)]["tokens_per_s"])
    return dict(pt, name=point_name(pt), **{k: rows[point_name(pt)][k] for k in ("tokens_per_s", "speedup_vs_ar")})


# --- the command -------------------------------------------------------------------------------------

def bench(cfg: BenchConfig) -> dict:
    """Run the comparison (or the sweep), write results.json, results.md and plots into cfg.out."""
    from .bench_report import write_report
    from .pipeline import load

    cfg.modes = parse_modes(",".join(cfg.modes)) if not isinstance(cfg.modes, str) else parse_modes(cfg.modes)
    if any(m != "ar" for m in cfg.modes) and cfg.draft_model is None and cfg.model is not None:
        raise ValueError("modes mirror, sd and mlx_sd need --draft-model (or use --modes ar)")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
                    "machine": machine()}
    pipe = load(cfg.model, cfg.draft_model, exit_adapter=cfg.exit_adapter)
    error: Optional[Exception] = None
    t0 = time.perf_counter()
    try:
        prompts = select_prompts(cfg, pipe)
        report["prompts"] = [{"category": p.category, "text": p.text, "tokens": len(p.ids), "truncated": p.truncated}
                             for p in prompts]
        report["target_layers"] = pipe.engine.n_layers
        report["pinning"] = pin_threads(pipe) if cfg.pin else {"pinned": False}
        run: dict = {"samples": []}
        try:
            (run_sweep if cfg.sweep else run_modes)(cfg, pipe, prompts, run)
        except Mismatch as e:
            error = e
            report["error"] = str(e)
        samples = run.pop("samples")
        report.update(run)
        keys = ["ar"] + [point_name(pt) for pt in run.get("points", [])] if cfg.sweep else run.get("modes", [])
        report["summary"] = table(samples, keys) if samples else {}
        if cfg.sweep and error is None:
            report["best"] = best_point(report["summary"]["all"], run["points"])
        report["samples"] = [asdict(s) for s in samples]
        report["threads"] = thread_report()
    finally:
        pipe.close()
    report["machine"]["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    report["wall_s"] = time.perf_counter() - t0
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    if error is not None:
        raise error
    write_report(report, out)
    return report
