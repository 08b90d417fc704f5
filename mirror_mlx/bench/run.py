"""`mirror-mlx bench`: Mirror-SD against what users would run instead, in one process (docs/design.md §7).

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
import sys
import time
from dataclasses import asdict, dataclass, replace
from itertools import product
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

from tqdm import tqdm

from ..drafts.recipes import DraftRecipe, mlx_draft_model, ss_draft
from ..drafts.recipes import mlx_draft as host_mlx_draft
from ..drafts.ss.model import load_ss_draft
from ..drafts.vocab import trim
from .baselines import best_mlx_sd, run_ar, run_mlx_sd
from .grid import DEFAULT_MODES, parse_modes, parse_sweep, point_name
from .machine import machine, pin_threads, thread_report
from .summary import Sample, best_point, table
from ..engine.stats import Stats
from ..options import PAPER_KNOBS, DecodeOptions
from ..pipeline import load
from ..prompts import load_prompts
from ..tune.cost_model import describe
from .decompose import costs_alone, points_ran

if TYPE_CHECKING:
    import mlx.nn as nn
    from ..pipeline import Pipeline

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
    modes: Sequence[str] = DEFAULT_MODES
    temp: float = 0.0
    kappa: Optional[int] = None  # None: each mode's best row in the pair's profile (`tune`), as a user gets it
    gamma: Optional[int] = None
    exit_layer: Optional[int] = DecodeOptions.exit_layer
    out: Path = Path("bench_out")
    sweep: Optional[str] = None
    seed: int = 0
    sd_ks: Sequence[int] = SD_KS
    sd_sweep_prompts: int = 2  # mlx_sd's num_draft_tokens is chosen on this many first prompts
    warmup_tokens: int = 16
    pin: bool = False
    decompose: bool = False  # time a step's pieces alone after the run (decompose.py)
    progress: bool = True


@dataclass
class PromptIds:
    category: str
    text: str
    ids: list[int]
    truncated: bool


def select_prompts(cfg: BenchConfig, pipe: "Pipeline") -> list[PromptIds]:
    """The prompts as token ids, cut to fit the target's context with max_tokens to spare."""
    limit = None if cfg.limit is None else cfg.skip + cfg.limit
    chosen = load_prompts(cfg.prompts, limit)[cfg.skip :]
    if not chosen:
        raise ValueError(f"no prompts left after skipping {cfg.skip}")
    room = None
    if pipe.context_length:
        room = pipe.context_length - cfg.max_tokens
        if room < 2:
            raise ValueError(f"max_tokens {cfg.max_tokens} leaves no room for a prompt in the target's "
                             f"context of {pipe.context_length} tokens: lower --max-tokens")
    out = []
    for p in chosen:
        ids = pipe.encode(p.text)
        cut = room is not None and len(ids) > room
        out.append(PromptIds(p.category, p.text, ids[:room] if cut else ids, cut))
    return out


def run_engine(pipe: "Pipeline", mode: str, p: PromptIds, index: int, max_tokens: int, temp: float, seed: int,
               kappa: int, gamma: int, exit_layer: Optional[int]) -> Sample:
    """`mirror` or `sd` through the Pipeline (stop=False: exactly max_tokens, as the baselines)."""
    r = pipe.generate(p.ids, max_tokens=max_tokens, temperature=temp, seed=seed, kappa=kappa, gamma=gamma,
                      exit_layer=exit_layer, mode=mode, stop=False)
    s = r.stats
    t0 = s.timeline[0]["prefix"][0] if s.timeline else 0.0
    timeline = [{k: _since(t0, k, v) for k, v in step.items()} for step in s.timeline]
    ran_as = s.mode if s.mode != mode else None  # a dropped draft runs as ar
    if mode == "auto" and s.mode != "ar":  # what auto chose for this prompt (at temperature 0 it adapts)
        ran_as = describe(s) + (" then ar" if s.left_draft else "")  # (ar once the text defeated the draft)
    return Sample(mode, index, p.category, list(r.tokens), replace(s, timeline=timeline), ran_as=ran_as)


def _since(t0: float, key: str, value: Union[float, tuple]) -> Union[float, tuple]:
    """A timeline entry on the clock of the generation's first step: an interval's ends (a serial window's
    third element is a duration), an arrival time; counts as they are."""
    if isinstance(value, tuple):
        return (value[0] - t0, value[1] - t0) + tuple(value[2:])
    return value - t0 if key == "arrived" else value


def run_baseline(pipe: "Pipeline", mode: str, p: PromptIds, index: int, max_tokens: int, temp: float, seed: int,
                 k: Optional[int] = None) -> Sample:
    """`ar` (generate_step) or `mlx_sd` (speculative_generate_step with k draft tokens)."""
    if mode == "ar":
        run = run_ar(pipe.model, p.ids, max_tokens, temp, seed=seed)
    else:
        assert k is not None, "mlx_sd drafts k tokens"
        run = run_mlx_sd(pipe.model, mlx_draft(pipe), p.ids, max_tokens, k, temp, seed=seed)
    stats = Stats(mode=mode, generation_tokens=len(run.tokens), target_forwards=run.target_forwards,
                  steps=run.target_forwards, decode_seconds=run.decode_s, peak_memory_gb=run.peak_memory / 1e9)
    return Sample(mode, index, p.category, list(run.tokens), stats, num_draft_tokens=k)


def mlx_draft(pipe: "Pipeline") -> "nn.Module":
    """The draft as an mlx-lm model in this process, for mlx-lm's own speculative decoding. An SS draft's
    forward over plain tokens is a plain llama's (its main rows), so mlx-lm drives it as a plain draft."""
    if isinstance(pipe.draft, DraftRecipe) and pipe.draft.build is host_mlx_draft:
        return mlx_draft_model(*pipe.draft.args)
    if isinstance(pipe.draft, DraftRecipe) and pipe.draft.build is ss_draft:  # (path,) or (path, kept ids)
        path, *kept = pipe.draft.args
        model = load_ss_draft(path, with_tokenizer=False)[0]
        return trim(model, *kept) if kept else model
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
    return tqdm(total=total, desc=desc, unit="run", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def run_modes(cfg: BenchConfig, pipe: "Pipeline", prompts: list[PromptIds], result: dict) -> None:
    """The mode comparison: warm-up, mlx_sd's k sweep, then every mode on every prompt, interleaved."""
    modes = list(cfg.modes)
    if "ar" not in modes:  # ar is the reference for the equality check and the speedups
        modes.append("ar")
    knobs = dict(kappa=cfg.kappa, gamma=cfg.gamma, exit_layer=cfg.exit_layer)  # None: the profile's, per mode
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
    result["ran"] = ran_with(result["samples"], k_best)


def ran_with(samples: Sequence[Sample], k_best: Optional[int]) -> dict:
    """{mode: its knobs, placement and why, in words}, from the last generation of each mode: what the
    table names beside each mode (the fixed modes' knobs come from the profile unless given)."""
    out = {}
    for s in samples:
        st = s.stats
        if s.mode == "mlx_sd":
            out[s.mode] = {"knobs": f"k={k_best}", "placement": "mlx-lm's own threads"}
        elif s.mode == "ar":
            out[s.mode] = {"knobs": "", "placement": "mlx-lm's own threads"}
        else:
            knobs = describe(st) if st.mode != "ar" or s.mode == "auto" else "ar"
            out[s.mode] = {"knobs": knobs, "placement": st.placement.split(" (")[0].split(":")[0], "why": st.why,
                           "placement_why": st.placement}
    return out


def one(pipe: "Pipeline", mode: str, p: PromptIds, index: int, cfg: BenchConfig, knobs: dict, max_tokens: int,
        k: Optional[int] = None) -> Sample:
    seed = cfg.seed + index
    if mode in ENGINE_MODES:
        if mode == "auto":  # the profile's knobs, not the command line's
            knobs = dict(kappa=None, gamma=None, exit_layer=None)
        return run_engine(pipe, mode, p, index, max_tokens, cfg.temp, seed, **knobs)
    return run_baseline(pipe, mode, p, index, max_tokens, cfg.temp, seed, k if mode == "mlx_sd" else None)


def run_sweep(cfg: BenchConfig, pipe: "Pipeline", prompts: list[PromptIds], result: dict) -> None:
    """Mirror mode over the (κ, γ, ℓ_e) grid, with `ar` on each prompt as reference and baseline."""
    assert cfg.sweep is not None, "a sweep's grid"
    default_exit = pipe.engine.exit_layer(DecodeOptions(exit_layer=cfg.exit_layer))  # an adapter's layer, else N/2
    grid = parse_sweep(cfg.sweep, pipe.engine.n_layers, cfg.kappa or PAPER_KNOBS["kappa"],
                       cfg.gamma or PAPER_KNOBS["gamma"], default_exit)
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


def bench(cfg: BenchConfig) -> dict:
    """Run the comparison (or the sweep), write results.json, results.md and plots into cfg.out."""
    try:
        from .report import write_report  # (optional: matplotlib, the bench extra)
    except ImportError as e:  # refused before any model is loaded or file written
        if (e.name or "").split(".")[0] != "matplotlib":
            raise
        raise ValueError("mirror-mlx bench draws its plots with matplotlib, which is not installed: "
                         "pip install 'mirror-mlx[bench]'") from None

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
        report["draft"] = Path(cfg.draft_model).name if cfg.draft_model else "llama2xs (demo)"  # (the tables' name)
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
        if cfg.decompose and samples and error is None:
            points = points_ran(samples, report["summary"])
            ar = next(s for s in samples if s.mode == "ar")  # the run's mean context: its prompt, half its tokens
            report["decompose"] = costs_alone(pipe, prompts[ar.prompt].ids + ar.tokens[: len(ar.tokens) // 2], points)
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
