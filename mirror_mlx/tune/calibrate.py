"""Calibrate the cost model on this machine and pick the fastest mode and knobs (`mirror-mlx tune`, and mode
auto's first call), by real forwards of the loaded models, in this order:
1. acceptance traces (tune/traces.py) at every candidate ℓ_e;
2. component timings (tune/timing.py): target forwards, prefix / suffix per ℓ_e, 1-row windows, rollouts,
   and suffix ‖ rollout together where it can change the top of the ranking;
3. per-mode overhead: real generations of a few probe configurations, step time minus the modelled
   components, fitted again after step 4 to all their runs;
4. predictions for the whole grid, then real generations of the top few (and ar) to confirm: the choice is
   the fastest confirmed configuration by its *measured* step time, never one only the model believed in.

Across ranks (under mlx.launch) every rank runs the same target forwards in the same order, so whatever a
timing decides is rank 0's decision, shared (timing.Lockstep); the draft is timed beside rank 0 alone, T_comm
is kept apart in the step model, and rank 0 alone gets the profile.
"""

import os
import random
import sys
import time
import zlib
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

from tqdm import tqdm

from ..engine.exit_adapter import adapter_for, adapter_layers
from ..proposers.lookup import LOOKUP_GAMMA
from ..proposers.recycle import RECYCLE
from . import profile as profiles
from .cost_model import Acceptance, Config, Timings, choose, component_time, expected_rate, grid, rank, row_config
from .placement import candidates
from .profile import PairView
from .timing import MIN_TIMED_S, Bench, Lockstep, interleaved, measure_parallel, split_comm
from .traces import calibration_prompts, greedy_texts, trace

if TYPE_CHECKING:
    from ..chunks import Result

TREE_TOKENS = 48  # the recycled tree's runs decode at least this many tokens: it learns as it goes, and proposes
# nothing in its first steps on an empty table (SmolLM2-135M: 1.0 tokens a forward over 16 tokens, 1.5 over 96)
SAMPLE_SEED = 0  # a calibration at a temperature above 0 samples with this seed: every mode the same text
QUICK_BUDGET_S = 30.0  # the first-call calibration's cap (MIRROR_MLX_QUICK_BUDGET overrides); then ar


class OutOfTime(RuntimeError):
    """The calibration's time budget ran out."""


def quick_budget() -> float:
    """Seconds the quick calibration may take: $MIRROR_MLX_QUICK_BUDGET, else QUICK_BUDGET_S."""
    try:
        return float(os.environ.get("MIRROR_MLX_QUICK_BUDGET") or QUICK_BUDGET_S)
    except ValueError:
        return QUICK_BUDGET_S


@dataclass
class TuneConfig:
    """How much to measure. `quick()` is the first-call calibration of mode="auto"."""

    prompts: int = 4  # their traces (one batch) give the acceptance; the first `confirm_prompts` also confirm
    max_tokens: int = 48
    kappas: tuple = (1, 2, 4, 8)
    gammas: tuple = (1, 2, 3, 5, 7)
    branches: tuple = (None, 2, 4, 8)  # mirror's branch budgets B (each below κ(γ+1)): predicted from the traces
    exit_layers: Optional[tuple] = None  # None: the adapter's layer, else N/4, N/3, N/2, 3N/4
    reps: int = 3
    confirm: int = 5  # the top predictions measured end to end (ar is always measured too)
    confirm_prompts: int = 2  # the confirmation runs on the first few calibration prompts (tune's time is mostly here)
    min_seconds: float = 4.0  # each real run set goes round its prompts until it has decoded this long
    min_timed_s: float = MIN_TIMED_S  # each timed piece is timed at least this long (`interleaved`)
    probe_two_windows: bool = True  # sd and mirror overhead probed at the smallest and middle γ (else the middle)
    exact_top: int = 5  # this many best predictions have suffix ‖ rollout measured (at least `confirm`)
    progress: bool = True
    budget_s: Optional[float] = None  # stop (OutOfTime) once calibration has taken this long; None: no cap
    temperature: float = 0.0  # the temperature the user runs: the traces follow the target's samples at it (seeded),
    # and the real runs sample at it, so the acceptance and the speeds are those of that setting

    @classmethod
    def quick(cls, temperature: float = 0.0) -> "TuneConfig":
        """Small on purpose (a first call waits for it): few prompts and knobs, one probe per mode, capped."""
        return cls(prompts=2, max_tokens=16, kappas=(1, 2), gammas=(1, 2, 3, 4, 5), branches=(None, 2, 4), reps=2,
                   confirm=2, confirm_prompts=1, min_seconds=0.5, min_timed_s=0.05, probe_two_windows=False,
                   exact_top=2, progress=False, budget_s=quick_budget(), temperature=temperature)


# --- 1. acceptance traces (tune/traces.py) at these exit layers ------------------------------------


def exit_layer_candidates(pipe: PairView, cfg: TuneConfig) -> list[int]:
    n = pipe.engine.n_layers
    quick = cfg.budget_s is not None and cfg.exit_layers is None  # the capped calibration: N/2 and the adapters' layers
    layers = cfg.exit_layers or ((n // 2,) if quick else (n // 4, n // 3, n // 2, 3 * n // 4))
    covered = adapter_layers(pipe.engine.exit_adapter)
    if covered and quick:  # and each adapter's shallowest exact layer: its state with the fewest layers to it
        ad = pipe.engine.exit_adapter
        layers = (*layers, *{min(e for e in covered if adapter_for(ad, e) is adapter_for(ad, c)) for c in covered})
    if covered:  # an adapter only maps the state of the layers it is exact at: the candidates among them
        return sorted({e for e in layers if e in covered}) or [pipe.engine.exit_adapter.exit_layer]
    return sorted({min(max(1, e), n - 1) for e in layers})


# --- 2. component timings (tune/timing.py) --------------------------------------------------------


def measure_timings(pipe: PairView, b: Bench, cfg: TuneConfig, layers: list[int], tick: Callable,
                    step: Lockstep) -> Timings:
    """Every component but suffix ‖ rollout together (`measure_parallel` does those where they matter).
    Across ranks (`step`) the target's pieces run on every rank as rank 0 decides, the draft's on rank 0
    alone, and T_comm is timed in the same rounds as the verify forwards (a burst of load hits both alike),
    then split off the target's pieces (`split_comm`)."""
    t = Timings()
    timed = partial(interleaved, reps=cfg.reps, tick=tick, min_s=cfg.min_timed_s)
    rows = sorted({1} | {g + 1 for g in cfg.gammas})
    forwards = {("verify", n): partial(b.verify, n) for n in rows}
    if step.group is not None:
        forwards.update({("comm", n): partial(b.comm, n, step.group) for n in rows})
    forwards = timed(forwards, step=step)
    t.verify = {n: forwards[("verify", n)] for n in rows}
    if b.draft is not None:  # the draft: in this process, or across ranks beside rank 0 only
        t.window = timed({g: partial(b.rollout, [[b.context[-1]]], g) for g in cfg.gammas})
        if pipe.engine.drafts_locally:  # sd drafts in-process: its window as it runs
            t.local_window = timed({g: partial(b.local_rollout, g) for g in cfg.gammas})
        # the rollout alone does not depend on ℓ_e
        t.rollout = timed({(k * (g + 1), g): partial(b.rollout, b.stems(k, g), g)
                           for g in cfg.gammas for k in cfg.kappas})
        t.prepare = timed({g: partial(b.prepare, g) for g in cfg.gammas})
    halves = timed({(layer, g + 1): partial(b.split, layer, g + 1) for layer in layers for g in cfg.gammas}, step=step)
    t.prefix = {k: v[0] for k, v in halves.items()}
    t.suffix = {k: v[1] for k, v in halves.items()}
    if step.group is not None:
        split_comm(t, {n: forwards[("comm", n)] for n in rows}, pipe.engine.n_layers)
    return t


# --- 3./4. real generations -----------------------------------------------------------------------

def sampled_texts(pipe: PairView, prompts: list[list[int]], max_tokens: int, temperature: float) -> list[list[int]]:
    """The target's own seeded sample at `temperature` after each prompt (the target alone): what a draft's window
    must match at that setting, as sd and mirror accept a token only where it equals the target's draw."""
    return [list(pipe.generate(p, None, mode="ar", max_tokens=max_tokens, temperature=temperature,
                               seed=SAMPLE_SEED).tokens) for p in prompts]


def pick_confirm(ranked: list[dict], n: int) -> list[Config]:
    """The `n` best predictions, at most ⌊n/2⌋ (at least one) of one window γ: the user's text may accept
    more or less than the calibration's, which moves whole γ groups (`adapt`), so alternatives stay measured."""
    cap, out, per = max(1, n // 2), list[Config](), dict[Optional[int], int]()
    for r in ranked:
        g = r["config"].gamma
        if len(out) < n and per.get(g, 0) < cap:
            out.append(r["config"])
            per[g] = per.get(g, 0) + 1
    return out


def run_configs(pipe: PairView, configs: list[Config], prompts: Union[list[list[int]], dict], max_tokens: int,
                warm_up: Union[bool, Sequence[Config]] = True, check: Callable[[], None] = lambda: None,
                sums: Optional[dict] = None, min_seconds: float = 0.0, step: Optional[Lockstep] = None,
                temperature: float = 0.0) -> dict:
    """Real generations of every config (in its own placement; greedy, or the seeded sample at `temperature`) on
    its prompts, interleaved in rounds (each config runs its next prompt, so a load change on a shared machine
    hits all alike). {config: tokens/s,
    step_s, reuse, sums}. `prompts`: one list for all, or {config: its list}; `sums`: a previous call's runs
    (of other prompts), added in; `warm_up`: a short run of every config first (True), of none, or of these.
    A config's prompts are gone through again until it has decoded `min_seconds` (single runs of a small
    model vary by ±25 % here); across ranks rank 0's seconds decide it, so every rank runs the same ones."""
    own = prompts if isinstance(prompts, dict) else {c: prompts for c in configs}
    knobs = {c: dict(mode=c.mode, max_tokens=max_tokens, kappa=c.kappa or 1, gamma=c.gamma or 1,
                     exit_layer=c.exit_layer, branches=c.branches) if c.mode != RECYCLE else
             dict(mode="sd", max_tokens=max(max_tokens, TREE_TOKENS), gamma=LOOKUP_GAMMA, lookup=True) for c in configs}
    sampled = dict(temperature=temperature, seed=SAMPLE_SEED) if temperature > 0 else {}  # one seeded text for all

    def generate(c: Config, prompt: list[int], **kw: object) -> "Result":
        pipe.auto.placement_forced = c.placement  # each config in its own placement (tune/placement.py)
        pipe.auto.proposer_forced = RECYCLE if c.mode == RECYCLE else ""  # the tree and lookup, as auto runs them
        try:
            return pipe.generate(prompt, None, **dict(knobs[c], **sampled, **kw))
        finally:
            pipe.auto.placement_forced, pipe.auto.proposer_forced = None, ""

    if warm_up:
        for c in configs if warm_up is True else warm_up:
            check()
            generate(c, own[c][0], max_tokens=4)
    sums = {c: list((sums or {}).get(c, (0, 0, 0, 0.0))) for c in configs}  # tokens, steps, reuses, seconds
    todo, r = [c for c in configs if own[c]], 0
    while todo:
        # each round in its own (seeded) order: whatever a run leaves behind on the machine does not always
        # fall on the same next configuration
        for c in random.Random(r).sample(todo, len(todo)):
            check()
            s = generate(c, own[c][r % len(own[c])]).stats
            for i, v in enumerate((s.generation_tokens, s.steps, s.reuses, s.decode_seconds)):
                sums[c][i] += v
        r += 1
        # a config is done after whole passes over its prompts that add up to min_seconds
        more = [r < len(own[c]) or r % len(own[c]) != 0 or sums[c][3] < min_seconds for c in todo]
        if step is not None and step.group is not None:
            more = step.flags(more)
        todo = [c for c, m in zip(todo, more) if m]
    return {c: {"tokens_per_second": tok / sec if sec else 0.0, "step_s": sec / max(steps, 1),
                "reuse": reuses / max(steps, 1), "sums": (tok, steps, reuses, sec)}
            for c, (tok, steps, reuses, sec) in sums.items()}


def probe_configs(cfg: TuneConfig, layers: list[int]) -> list[Config]:
    """Configurations run for real to measure each mode's overhead: ar; sd and mirror at the smallest
    and the middle γ (their overhead grows with the window)."""
    gs = sorted({cfg.gammas[len(cfg.gammas) // 2]} | ({cfg.gammas[0]} if cfg.probe_two_windows else set()))
    e = layers[len(layers) // 2]
    return [Config("ar")] + [Config("sd", gamma=g) for g in gs] + [Config("mirror", cfg.kappas[0], g, e) for g in gs]


def fit_overheads(t: Timings, runs: dict) -> None:
    """t.overhead[mode][γ] from the probes' real runs: step time minus the modelled components (scheduling,
    messages, sampling, Python)."""
    for c, run in runs.items():
        t.overhead.setdefault(c.mode, {})[c.gamma or 0] = run["step_s"] - component_time(c, t, run["reuse"])


def measured_row(c: Config, run: dict) -> dict:
    """A table row for a configuration the step model does not predict, its prediction its measurement."""
    tokens, steps, _, _ = run["sums"]
    step_ms = 1e3 * run["step_s"]
    return dict(asdict(c), predicted=run["tokens_per_second"], measured=run["tokens_per_second"],
                measured_step_ms=step_ms, probe=False, confirmed=True, bound=False,
                tokens_per_step=tokens / max(steps, 1), reuse=0.0, step_ms=step_ms, comm_ms=0.0)


def place_row(row: dict, runs: dict) -> None:
    """A table row's placement: where its point was measured in more than one (`runs`: {placement: its run
    or None}), the faster one's run becomes the row's measurement, row["placements"] keeps each one's
    tokens/s. The other rows (and ar and sd, which always run unpinned) say "unpinned"."""
    runs = {p: run for p, run in runs.items() if run is not None}
    row["placement"] = "unpinned"
    if len(runs) < 2:
        return
    row["placements"] = {p: run["tokens_per_second"] for p, run in runs.items()}
    win = max(runs, key=lambda p: runs[p]["tokens_per_second"])
    row["placement"] = win
    row["measured"], row["measured_step_ms"] = runs[win]["tokens_per_second"], 1e3 * runs[win]["step_s"]


class _Phases:
    """tune's progress: one bar per phase (its true total, or None where the rounds are not known ahead), the
    seconds each phase took, and the time budget, checked at every tick (across ranks there is none: a budget
    would stop the ranks at different points)."""

    def __init__(self, cfg: TuneConfig, step: Lockstep):
        self.cfg, self.step = cfg, step
        self.started = self.lap = time.perf_counter()
        self.bars: list = []
        self.seconds: dict[str, float] = {}

    def check(self) -> None:
        if self.step.group is None and self.cfg.budget_s is not None \
                and time.perf_counter() - self.started > self.cfg.budget_s:
            raise OutOfTime(f"calibration passed its {self.cfg.budget_s:g} s budget")

    def begin(self, name: str, total: Optional[int]) -> None:
        self.close()
        self.bars.append(tqdm(total=total, desc=f"tune: {name}", unit="step", disable=not self.cfg.progress,
                              file=sys.stderr, dynamic_ncols=True))

    def tick(self) -> None:
        self.bars[-1].update(1)
        self.check()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase], self.lap = now - self.lap, now

    def close(self) -> None:
        if self.bars:
            self.bars[-1].close()


def _lockstep(pipe: PairView, cfg: TuneConfig) -> Lockstep:
    """Who decides (timing.Lockstep), after refusing what tune cannot calibrate."""
    if pipe.draft is None:
        raise ValueError("tune needs a draft model (without one the only mode is ar): pass --draft-model")
    if not pipe.engine.has_draft:
        raise RuntimeError(f"the draft was dropped earlier ({pipe.engine.draft_failure})")
    step = Lockstep(pipe)
    if step.group is not None and getattr(pipe, "split", "tensor") != "tensor":
        raise ValueError("tune across ranks measures the target split tensor-parallel (every rank runs every "
                         "layer), and this one is split by layers (mlx-lm's pipeline split): give mirror's or sd's "
                         "knobs instead (--kappa, --gamma, --exit-layer)")
    if step.group is not None and cfg.budget_s is not None:
        print(f"mirror-mlx: across ranks the calibration has no time budget (the {cfg.budget_s:g} s cap would stop "
              "the ranks at different points): it runs to the end", file=sys.stderr)
    return step


def _prompts(pipe: PairView, cfg: TuneConfig, path: Optional[str], step: Lockstep) -> list[list[int]]:
    """The calibration prompts; across ranks the same on every rank (the same forwards need them)."""
    prompts = calibration_prompts(pipe, cfg.prompts, path)
    if step.group is not None:
        digest = zlib.crc32(repr(prompts).encode()) & 0x7FFFFFFF
        if step.ints([digest], 1)[0] != digest:
            raise ValueError(f"rank {step.group.rank()}'s calibration prompts differ from rank 0's: --prompts must "
                             "name the same file on every host")
    return prompts


def _measure(pipe: PairView, cfg: TuneConfig, ph: _Phases, step: Lockstep, prompts: list[list[int]],
             layers: list[int], configs: list[Config], probes: list[Config], placements: Sequence[str]
             ) -> tuple[Acceptance, Timings, dict, list[Config], int]:
    """Steps 1-4 of the module's docstring, in that order: the traces' acceptance, the component timings, the
    real runs by configuration, the configurations confirmed, and how many suffix ‖ rollout points were timed."""
    top = max(cfg.confirm, cfg.exact_top)  # the predictions that decide what is confirmed are all measured ones
    ph.begin("traces", len(prompts))
    traces = []
    texts = sampled_texts(pipe, prompts, cfg.max_tokens, cfg.temperature) if cfg.temperature > 0 else None
    with pipe.lock:  # direct use of the target and the host: no generation of another thread meanwhile
        for p, text in zip(prompts, texts or greedy_texts(pipe, prompts, cfg.max_tokens)):
            traces.append(trace(pipe, p, cfg.max_tokens, layers, max(cfg.gammas), text=text))
            ph.tick()
        acc = Acceptance([tr for tr, _ in traces])
        ph.done("traces")
        bench = Bench(pipe, traces[0][1])  # over a prompt and its greedy text
        # measure_timings' pieces: the verify widths, the windows, the rollouts, the prepares, the split forwards
        ph.begin("timings", len({1} | {g + 1 for g in cfg.gammas}) + 2 * len(cfg.gammas)
                 + len(cfg.gammas) * len(cfg.kappas) + len(layers) * len(cfg.gammas)
                 + len(cfg.gammas) * pipe.engine.drafts_locally)  # sd's in-process windows
        t = measure_timings(pipe, bench, cfg, layers, ph.tick, step)
    parallel = lambda among, n: measure_parallel(pipe, bench, t, among, acc, n, cfg.reps, ph.tick,  # noqa: E731
                                                 cfg.min_timed_s, step)
    mirror_probes = [c for c in probes if c.mode == "mirror"]
    ph.begin("suffix ‖ rollout", None)  # rounds until the top is measured: not known ahead
    parallel(mirror_probes, len(mirror_probes))
    ph.done("timings")
    ph.begin("probes", len(probes))
    # the probes on the first prompt (the confirmation adds the others)
    probe_runs = run_configs(pipe, probes, prompts[:1], cfg.max_tokens, check=ph.check,
                             min_seconds=cfg.min_seconds / 2, step=step, temperature=cfg.temperature)
    if step.lead:  # (across ranks only rank 0 holds the draft's timings)
        fit_overheads(t, probe_runs)
    ph.bars[-1].update(len(probes))
    ph.done("probes")
    ph.begin("suffix ‖ rollout", None)
    n_parallel = parallel(configs, top)
    ph.done("parallel")
    confirm = _to_confirm(configs, t, acc, cfg, placements, step)
    splits = [replace(c, placement="split") for c in confirm if c.mode == "mirror"] if "split" in placements else []
    # The top predictions and ar, on the first few prompts: probes among them add the other prompts
    # to their runs on the first; the probes outside stay measured on one prompt and are not candidates.
    own = {c: prompts[1 if c in probes else 0: cfg.confirm_prompts] for c in confirm}
    own.update({c: prompts[: cfg.confirm_prompts] for c in splits})  # the prompts its unpinned twin covers
    ph.begin("confirm", len(confirm) + len(splits))
    runs = dict(probe_runs)
    runs.update(run_configs(pipe, confirm + splits, own, cfg.max_tokens, warm_up=splits, check=ph.check,
                            min_seconds=cfg.min_seconds, sums={c: r["sums"] for c, r in probe_runs.items()},
                            step=step, temperature=cfg.temperature))
    ph.bars[-1].update(len(confirm) + len(splits))
    ph.begin("suffix ‖ rollout", None)
    # The probes' overheads again from all their runs, the confirmation's too: on a ms-scale pair the
    # machine's speed moves 10-20 % between the probe runs and the confirmation seconds later, and a
    # fit to twice the runs follows the calibration's whole span (the table's predictions use it).
    if step.lead:
        fit_overheads(t, {c: runs[c] for c in probes})
    n_parallel += parallel(configs, top)
    ph.done("confirm")
    return acc, t, runs, confirm, n_parallel


def _to_confirm(configs: list[Config], t: Timings, acc: Acceptance, cfg: TuneConfig, placements: Sequence[str],
                step: Lockstep) -> list[Config]:
    """The configurations run for real to confirm: the best predictions (`pick_confirm`), ar, the recycled tree
    with the lookup (no draft model: where the draft does not pay, it may; in one process), and where mirror
    may run split, the best mirror prediction at least; rank 0's pick on every rank."""
    confirm = None
    if step.lead:
        ranked = rank(configs, t, acc)
        confirm = pick_confirm(ranked, cfg.confirm)
        confirm += [Config("ar")] if Config("ar") not in confirm else []
        confirm += [Config(RECYCLE)] if step.group is None else []
        if "split" in placements and not any(c.mode == "mirror" for c in confirm):
            confirm += [next(r["config"] for r in ranked if r["config"].mode == "mirror")]
    if step.group is not None:
        return step.pick(confirm, configs)
    assert confirm is not None, "in one process this process is rank 0"
    return confirm


def calibrate(pipe: PairView, cfg: TuneConfig = TuneConfig(), prompts_file: Optional[str] = None,
              log: Callable[[str], None] = lambda s: None, key: Optional[dict] = None) -> Optional[profiles.Profile]:
    """Measure, predict, confirm; the profile (not yet saved) with the fastest measured configuration.
    `key`: the pair's profile key (profile.key_for), computed here when not given.

    Across ranks (a DistributedPipeline) every rank must call it: rank 0 returns the profile, the other
    ranks None (they run the target's forwards as rank 0 decides, `Lockstep`)."""
    step = _lockstep(pipe, cfg)
    ph = _Phases(cfg, step)
    prompts = _prompts(pipe, cfg, prompts_file, step)
    placements = candidates(pipe)  # mirror's confirmed points run in each (tune/placement.py)
    layers = exit_layer_candidates(pipe, cfg)
    configs = grid(cfg.kappas, cfg.gammas, layers, branches=cfg.branches)
    probes = probe_configs(cfg, layers)
    try:
        acc, t, measured, confirm, n_parallel = _measure(pipe, cfg, ph, step, prompts, layers, configs, probes,
                                                         placements)
    finally:
        ph.close()
    if not step.lead:  # a rank beside rank 0: it ran the target's side; rank 0 holds the profile
        return None
    ranked = rank(configs, t, acc)
    table = [dict(asdict(r["config"]), predicted=r["tokens_per_second"],
                  measured=measured[r["config"]]["tokens_per_second"] if r["config"] in measured else None,
                  measured_step_ms=1e3 * measured[r["config"]]["step_s"] if r["config"] in measured else None,
                  probe=r["config"] in probes, confirmed=r["config"] in confirm, bound=r["bound"],
                  tokens_per_step=r["tokens_per_step"], reuse=r["reuse"], step_ms=1e3 * r["step_s"],
                  comm_ms=1e3 * r["comm_s"]) for r in ranked]
    for row, r in zip(table, ranked):
        place_row(row, {p: measured.get(replace(r["config"], placement=p)) for p in placements})
    if Config(RECYCLE) in measured:  # measured only: no step model predicts a tree sized by its own costs
        table.append(measured_row(Config(RECYCLE), measured[Config(RECYCLE)]))
    best, ar, margin = choose(table)
    c = row_config(best)
    placed = f", placement {best['placement']}" if best["mode"] == "mirror" else ""
    why = (f"tuned: {expected_rate(best):.0f} tok/s expected{placed} vs ar {expected_rate(ar):.0f}"
           f" (measured {best['measured']:.0f}, predicted {best['predicted']:.0f}; best of {len(confirm)} confirmed, "
           f"{len(configs)} predicted{margin})")
    calibration = {"seconds": time.perf_counter() - ph.started, "phases": ph.seconds, "prompts": len(prompts),
                   "max_tokens": cfg.max_tokens, "parallel_measured": n_parallel, "temperature": cfg.temperature,
                   # γ: [accepted, rejections]
                   "acceptance": {str(g): list(acc.window_counts(g)) for g in cfg.gammas},
                   "timings": {k: {str(kk): v for kk, v in d.items()} for k, d in asdict(t).items()}}
    if step.group is not None:
        calibration["ranks"] = step.group.size()
    log(f"calibrated in {calibration['seconds']:.1f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in ph.seconds.items()) + ")")
    key = key if key is not None else profiles.pipe_key(pipe)
    return profiles.Profile(key=key, mode=c.mode, kappa=c.kappa, gamma=c.gamma, exit_layer=c.exit_layer,
                            branches=c.branches, why=why, table=table, calibration=calibration)
