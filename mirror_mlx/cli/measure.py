"""`mirror-mlx tune`, `bench`, `omega` and `doctor`: measuring the pair and this machine (defaults from TuneConfig
and BenchConfig)."""

from pathlib import Path
from typing import Union

import click

from mirror_mlx import distributed, doctor
from mirror_mlx.bench.machine import pin_threads
from mirror_mlx.bench.run import BenchConfig, Mismatch, bench
from mirror_mlx.cli import load_pipeline, model_options, refusing
from mirror_mlx.tune import profile, report
from mirror_mlx.tune.calibrate import OutOfTime, TuneConfig, calibrate
from mirror_mlx.tune.compute_plan import report as compute_plan_report
from mirror_mlx.tune.cost_model import describe
from mirror_mlx.tune.omega import run_omega

TUNE = TuneConfig()
BENCH = BenchConfig()


@click.command("tune")
@model_options
@click.option("--prompts", "prompts_file", default=None,
              help="Calibration prompts: FILE.jsonl (a 'prompt' or 'turns' field per line) or a prompt set name "
                   "[default: held-out TinyStories openings].")
@click.option("--limit", type=click.IntRange(min=1), default=TUNE.prompts, show_default=True,
              help="Calibration prompts.")
@click.option("--max-tokens", "-m", type=click.IntRange(min=4), default=TUNE.max_tokens, show_default=True,
              help="Greedy tokens per calibration prompt.")
@click.option("--confirm", type=click.IntRange(min=1), default=TUNE.confirm, show_default=True,
              help="Top predictions to measure end to end.")
@click.option("--min-seconds", type=click.FloatRange(min=0), default=TUNE.min_seconds, show_default=True,
              help="Each configuration run for real goes round its prompts until it has decoded this long.")
@click.option("--temperature", "--temp", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="The temperature you sample at: the draft's acceptance and every mode's speed are measured on the "
                   "target's own seeded samples at it (auto then adapts to other settings as it runs).")
@click.option("--quick", is_flag=True, help="The few-second calibration that mode=auto runs on first use (its own "
              "small set: not with --limit, --max-tokens, --confirm or --min-seconds).")
@click.option("--pin", is_flag=True, help="The Mac analog, as `bench --pin`: the target side on one core in every "
              "mode and the draft on another (Linux; set OPENBLAS_NUM_THREADS=1 too); its profile is kept apart "
              "from the unpinned one. "
              "Without it tune measures mirror unpinned and split (target side and draft host on cores of their "
              "own) and auto runs the faster.")
def tune_cmd(model, draft_model, exit_adapter, prompts_file, limit, max_tokens, confirm, min_seconds, temperature,
             quick, pin) -> None:
    """Measure this machine, predict every (mode, κ, γ, ℓe), confirm the best and save the profile auto uses.

    Under mlx.launch every rank measures the sharded target in step with rank 0, which times the draft,
    prints the table and saves the profile (kept apart by rank count)."""
    if pin and distributed.group() is not None:
        raise click.UsageError("--pin pins one process's threads: under mlx.launch run tune without it")
    ctx = click.get_current_context()
    sized = [f"--{n.replace('_', '-')}" for n in ("limit", "max_tokens", "confirm", "min_seconds")
             if ctx.get_parameter_source(n) is not click.core.ParameterSource.DEFAULT]
    if quick and sized:
        raise click.UsageError(f"--quick measures its own small set, so {', '.join(sized)} would be ignored: "
                               "drop --quick or those flags")
    pipe = load_pipeline(model, draft_model, exit_adapter, "auto")
    if pin:
        click.echo(f"pinning: {pin_threads(pipe)}", err=True)
    cfg = TuneConfig.quick(temperature) if quick else TuneConfig(prompts=limit, max_tokens=max_tokens, confirm=confirm,
                                                                 min_seconds=min_seconds, temperature=temperature)
    if quick:
        cfg.progress = True
    try:
        prof = calibrate(pipe, cfg, prompts_file)
    except ValueError as e:
        raise click.UsageError(str(e))
    except OutOfTime as e:  # --quick's cap on a slow or busy machine: nothing saved, one line
        raise click.ClickException(f"{e}: nothing saved; raise MIRROR_MLX_QUICK_BUDGET (seconds) or run tune "
                                   "without --quick") from None
    except RuntimeError as e:  # under mlx.launch: a rank lost (or that stopped on bad input) ends this one too
        if distributed.group() is not None and distributed.lost_peer(e):
            distributed.die(f"lost a rank of the group ({e}): stopping")
        raise
    finally:
        pipe.close()
    if prof is None:  # a rank beside rank 0 under mlx.launch: rank 0 prints and saves
        return
    path: Union[Path, str]
    try:
        path = profile.save(prof)
    except profile.ProfileError as e:  # an unwritable cache: the table below is still worth reading
        path = f"nothing ({e})"
    click.echo(report.format_table(prof))
    for line in (report.contention(prof), report.placement_line(prof), report.acceptance_line(prof),
                 report.comm_line(prof), compute_plan_report(draft_model)):
        if line:
            click.echo(line)
    at = f" at temperature {temperature:g}" if temperature > 0 else ""
    click.echo(f"chose {describe(prof)}{at}: {prof.why}")
    split = ", ".join(f"{k} {v:.0f} s" for k, v in prof.calibration.get("phases", {}).items())
    click.echo(f"calibrated in {prof.calibration['seconds']:.0f} s ({split}) on {prof.key['machine']}; wrote {path}")


@click.command("omega")
@click.option("--model", default=None, help="Target model [default: the embedded demo target].")
@click.option("--draft-model", default=None, help="Draft whose greedy token each row excludes [default: demo draft].")
@click.option("--exit-adapter", "exit_adapters", multiple=True, type=click.Path(dir_okay=False),
              help="An adapter from train-exit (repeat for several layers).")
@click.option("--prompts", type=int, default=50, show_default=True, help="Held-out TinyStories openings.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Greedy tokens per opening.")
@click.option("--exit-layer", "layers", type=int, multiple=True, help="Layers to measure [default: all].")
def omega_cmd(model: str | None, draft_model: str | None, exit_adapters: tuple[str, ...], prompts: int,
              max_tokens: int, layers: tuple[int, ...]) -> None:
    """Print Omega_kappa, the target's mass inside the early-exit top-kappa, at every exit layer."""
    click.echo(refusing(ValueError, run_omega, model, draft_model, exit_adapters, prompts, max_tokens, layers or None))


@click.command("bench")
@model_options
@click.option("--prompts", default=BENCH.prompts, show_default=True,
              help="tinystories, spec_bench, mt_bench or FILE.jsonl (a 'prompt' or 'turns' field per line).")
@click.option("--limit", type=click.IntRange(min=1), default=BENCH.limit, show_default=True, help="Prompts to run.")
@click.option("--skip", type=click.IntRange(min=0), default=BENCH.skip, show_default=True,
              help="Leave out the first N prompts (e.g. those a sweep chose the knobs on).")
@click.option("--max-tokens", "-m", type=click.IntRange(min=1), default=BENCH.max_tokens, show_default=True)
@click.option("--modes", default=",".join(BENCH.modes), show_default=True,
              help="Comma-separated: mirror, sd (ours), mlx_sd, ar (mlx-lm's own), auto (the tuned choice); "
                   "ar always runs as reference.")
@click.option("--temp", type=float, default=BENCH.temp, show_default=True, help="Sampling temperature.")
@click.option("--kappa", type=int, default=BENCH.kappa,
              help="Top-κ width at the early exit [default: mirror's best row in the pair's profile, from tune].")
@click.option("--gamma", type=int, default=BENCH.gamma,
              help="Window length γ (mirror and sd) [default: each mode's best row in the pair's profile].")
@click.option("--exit-layer", type=int, default=BENCH.exit_layer,
              help="Early-exit layer ℓ_e [default: mirror's best row in the profile; "
                   "the sweep: the adapter's, else N/2].")
@click.option("--seed", type=int, default=BENCH.seed, show_default=True, help="Seed of prompt i is seed + i.")
@click.option("--sweep", default=None,
              help='Instead of the mode comparison, mirror over a grid, e.g. "kappa=1,4,8,16 gamma=3,5,7 '
                   'exit=N/4,N/2,3N/4".')
@click.option("--pin", is_flag=True, help="The Mac analog: the target side and mlx-lm's baselines on one core in "
              "every mode, the draft on another (Linux; set OPENBLAS_NUM_THREADS=1 too). Without it every mode "
              "runs in the placement the product picks (tune's profile; mlx-lm with its defaults).")
@click.option("--decompose", is_flag=True, help="After the run, time each piece of a mirror and an sd step alone and "
              "compare each measured step with Eq. 10 built from them.")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder for results.json, results.md and the plots.")
def bench_cmd(**kwargs) -> None:
    """Mirror-SD against mlx-lm's generate_step and speculative decoding, same prompts, one process."""
    try:
        report = bench(BenchConfig(**kwargs))
    except Mismatch as e:
        raise click.ClickException(f"{e} (partial results in {kwargs['out']}/results.json)")
    except ValueError as e:
        raise click.UsageError(str(e))
    click.echo((kwargs["out"] / "results.md").read_text())
    if report.get("best"):
        click.echo(f"best sweep point: {report['best']['name']}")


@click.command("doctor")
@click.option("--model", default=None, help="Target for the overlap probe [default: the embedded demo pair].")
@click.option("--draft-model", default=None, help="Draft; a .mlpackage also gets its Core ML compute plan.")
@click.option("--seconds", type=click.FloatRange(min=0.5), default=2.0, show_default=True, help="Overlap probe length.")
def doctor_cmd(model: str | None, draft_model: str | None, seconds: float) -> None:
    """What this machine can do: OS, chip, Python, MLX, Core ML, and a target ‖ draft overlap probe."""
    for line in doctor.report(model, draft_model, seconds):
        click.echo(line)
