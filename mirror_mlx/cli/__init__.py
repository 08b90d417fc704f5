"""The `mirror-mlx` command line: one click group and the flags its verbs share (every default read
from DecodeOptions). Each group of verbs is a small module, imported only when one of its verbs runs
(so `generate` never loads coremltools or the trainers)."""

import importlib
import re
import sys
from typing import Optional

import click

import mirror_mlx
from mirror_mlx.options import CHOICES, DecodeOptions

VERBS = {  # verb -> "module:command"; the order `--help` lists them in
    "generate": "mirror_mlx.cli.generate:generate_cmd",
    "cache-prompt": "mirror_mlx.cli.generate:cache_prompt_cmd",
    "chat": "mirror_mlx.cli.chat:chat_cmd",
    "serve": "mirror_mlx.cli.serve:serve_cmd",
    "tune": "mirror_mlx.cli.measure:tune_cmd",
    "bench": "mirror_mlx.cli.measure:bench_cmd",
    "omega": "mirror_mlx.cli.measure:omega_cmd",
    "doctor": "mirror_mlx.cli.measure:doctor_cmd",
    "import-llama2c": "mirror_mlx.cli.build:import_llama2c_cmd",
    "widen": "mirror_mlx.cli.build:widen_cmd",
    "widen-exit": "mirror_mlx.cli.build:widen_exit_cmd",
    "train-draft": "mirror_mlx.cli.build:train_draft_cmd",
    "train-exit": "mirror_mlx.cli.build:train_exit_cmd",
    "convert": "mirror_mlx.convert.command:convert_cmd",  # ANE draft packages: convert/coreml.py
}


class Verbs(click.Group):
    """Verbs loaded on use (VERBS); usage errors print one line (`mirror-mlx VERB: error: ...`) and exit 2,
    with no usage block."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(VERBS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in VERBS:
            return None
        module, attr = VERBS[name].split(":")
        return getattr(importlib.import_module(module), attr)

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else "mirror-mlx"
            click.echo(f"{where}: error: {e.format_message()}", err=True)
            sys.exit(2)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except click.Abort as e:
            if isinstance(e.__cause__, KeyboardInterrupt):  # Ctrl-C: the shell's convention, 128 + SIGINT
                sys.exit(130)
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=Verbs, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(mirror_mlx.__version__, prog_name="mirror-mlx")
def main() -> None:
    """Mirror Speculative Decoding: an MLX target and a draft that run at the same time."""


def exit_on_terminate() -> None:
    """SIGTERM and SIGHUP (the terminal closed) end the command through its `finally`, so the pipeline
    stops its draft host and unlinks its shared memory itself: a hang-up reaches the whole process
    group, multiprocessing's resource tracker included, which would otherwise leave them behind."""
    import signal

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    tracker_ignores_hangup()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def tracker_ignores_hangup() -> None:
    """Start multiprocessing's resource tracker with SIGHUP ignored (it inherits that, as it already
    ignores SIGINT and SIGTERM): a hang-up of the process group must leave it there to see the shared
    memory unlinked. Call before anything makes shared memory."""
    import signal
    from multiprocessing import resource_tracker

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGHUP, previous)


DEFAULTS = DecodeOptions()  # the one source of every decoding default


def model_options(f):
    """--model / --draft-model / --exit-adapter, shared by generate, chat and bench."""
    f = click.option("--exit-adapter", type=click.Path(dir_okay=False), default=None,
                     help="A learned early-exit adapter for the target (train-exit); 'none' turns off the demo's.")(f)
    f = click.option("--draft-model", default=None,
                     help="Draft: MLX model folder, SS draft folder, .mlpackage (macOS) or HF id.")(f)
    f = click.option("--model", default=None,
                     help="Target: model folder or Hugging Face id [default: the embedded demo pair].")(f)
    return f


def with_options(opts: list):
    """A decorator applying click options in the order listed."""
    def apply(f):
        for opt in reversed(opts):
            f = opt(f)
        return f
    return apply


def knob_options(gamma_help: str) -> list:
    """--kappa / --gamma / --exit-layer, Mirror-SD's knobs (generate, chat, bench)."""
    return [
        click.option("--kappa", type=int, default=DEFAULTS.kappa,
                     help="Top-κ width at the early exit [default: the pair's profile's (auto's choice, or the "
                          "best for --mode; uncalibrated: 1)]."),
        click.option("--gamma", type=int, default=DEFAULTS.gamma,
                     help=f"{gamma_help} [default: the pair's profile's, as --kappa; uncalibrated: 3]"),
        click.option("--exit-layer", type=int, default=DEFAULTS.exit_layer,
                     help="Early-exit layer ℓ_e [default: the pair's profile's, else the exit adapter's, else N/2]."),
    ]


def decode_options(max_tokens: int, seed: Optional[int]):
    """mlx-lm's sampling flags (its defaults: generate -m 100, chat -m 256 and --seed 0) plus Mirror-SD's knobs."""
    return with_options([
        click.option("--max-tokens", "-m", type=int, default=max_tokens, show_default=True),
        click.option("--temp", type=float, default=DEFAULTS.temperature, show_default=True,
                     help="Sampling temperature."),
        click.option("--top-p", type=float, default=DEFAULTS.top_p, show_default=True),
        click.option("--min-p", type=float, default=DEFAULTS.min_p, show_default=True),
        click.option("--top-k", type=int, default=DEFAULTS.top_k, show_default=True),
        click.option("--seed", type=int, default=seed, show_default=seed is not None,
                     help="Seed for sampling: the same seed gives the same tokens in every --mode."),
        click.option("--max-kv-size", type=int, default=DEFAULTS.max_kv_size,
                     help="As mlx-lm's, but a rotating cache cannot roll back draft tokens: taken only when "
                          "prompt + --max-tokens fit in it (then exact), else refused."),
        *knob_options("Window length γ."),
        click.option("--mode", type=click.Choice(CHOICES), default=DEFAULTS.mode, show_default=True,
                     help="auto: the tuned choice for this pair and machine (`mirror-mlx tune`)."),
    ])


def mlx_lm_load_options(f):
    """mlx_lm.load's flags, for generate and chat."""
    f = click.option("--trust-remote-code", is_flag=True, help="Allow the tokenizer's own code (as mlx-lm).")(f)
    f = click.option("--adapter-path", type=click.Path(file_okay=False), default=None,
                     help="LoRA adapters (mlx_lm.lora's folder) applied to the target.")(f)
    return f


FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temp", "top_p": "--top-p", "top_k": "--top-k",
         "min_p": "--min-p", "kappa": "--kappa", "gamma": "--gamma", "seed": "--seed", "exit_layer": "--exit-layer",
         "max_kv_size": "--max-kv-size", "adapter_path": "--adapter-path", "draft_model=...": "--draft-model",
         "mode='ar'": "--mode ar"}


def usage_error(e: Exception) -> click.UsageError:
    """The API's one sentence, naming CLI flags instead of Python keywords ("temperature must ..." -> "--temp must ...")."""
    text = str(e)
    for keyword, flag in FLAGS.items():
        text = re.sub(r"(?<![\w-])" + re.escape(keyword) + r"(?![\w])", flag, text)
    return click.UsageError(text)


def load_pipeline(model, draft_model, exit_adapter, mode: str, adapter_path=None, trust_remote_code=False,
                  tokenizer_config=None):
    """Load for the CLI: bad paths and mismatched pairs become one-line usage errors."""
    from mirror_mlx.pipeline import load

    if model is None and draft_model is None:
        click.echo("mirror-mlx: no --model given: using the embedded demo pair (stories260K + llama2xs)", err=True)
    elif model is None:
        click.echo(f"mirror-mlx: no --model given: using the embedded demo target (stories260K) with the draft "
                   f"{draft_model}", err=True)
    try:
        return load(model, None if mode == "ar" and model is not None and draft_model is None else draft_model,
                    exit_adapter=exit_adapter, adapter_path=adapter_path, trust_remote_code=trust_remote_code,
                    tokenizer_config=tokenizer_config)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise usage_error(e)


def generation_kwargs(max_tokens, temp, top_p, min_p, top_k, seed, max_kv_size, kappa, gamma, exit_layer,
                      mode) -> dict:
    return dict(max_tokens=max_tokens, temperature=temp, top_p=top_p, min_p=min_p, top_k=top_k, seed=seed,
                max_kv_size=max_kv_size, kappa=kappa, gamma=gamma, exit_layer=exit_layer, mode=mode)


def template_config(text):
    """--chat-template-config: a JSON object of extra template variables."""
    import json

    if text is None:
        return {}
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise click.UsageError(f"--chat-template-config is not valid JSON ({e.msg}): give an object like "
                               '\'{"enable_thinking": false}\'')
    if not isinstance(config, dict):
        raise click.UsageError('--chat-template-config must be a JSON object, like \'{"enable_thinking": false}\'')
    return config


def read_prompt(prompt: str) -> str:
    """--prompt: '-' reads stdin; text that is not valid UTF-8 is decoded with U+FFFD, said once."""
    from mirror_mlx.validate import REPLACED, clean_text

    if prompt == "-":
        prompt = sys.stdin.buffer.read().decode("utf-8", "surrogateescape")
    prompt, replaced = clean_text(prompt)
    if replaced:
        click.echo(f"mirror-mlx: note: {REPLACED}", err=True)
    return prompt


