"""The `mirror-mlx` command line: one click group and the flags its verbs share (every default read
from DecodeOptions). Each group of verbs is a small module, imported only when one of its verbs runs
(so `generate` never loads coremltools or the trainers)."""

import importlib
import json
import os
import signal
import sys
from functools import partial
from multiprocessing import resource_tracker
from typing import Callable, Literal, NoReturn, Optional, Sequence, TypeVar, Union, overload

import click

import mirror_mlx
from mirror_mlx import demo as demo_pair
from mirror_mlx.options import CHOICES, DecodeOptions
from mirror_mlx.validate import BadOption, BadType, REPLACED, clean_text

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" banner (nor in the draft host)

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
    "import-gguf": "mirror_mlx.cli.build:import_gguf_cmd",
    "real-pair": "mirror_mlx.cli.build:real_pair_cmd",
    "widen": "mirror_mlx.cli.build:widen_cmd",
    "widen-exit": "mirror_mlx.cli.build:widen_exit_cmd",
    "train-draft": "mirror_mlx.cli.build:train_draft_cmd",
    "train-exit": "mirror_mlx.cli.build:train_exit_cmd",
    "distill": "mirror_mlx.cli.distill:distill_cmd",  # a first-layers draft with a trimmed head: train/distill.py
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

    @overload  # click's two signatures: standalone, it exits; otherwise it returns what the verb returned
    def main(self, args: Optional[Sequence[str]] = None, prog_name: Optional[str] = None,
             complete_var: Optional[str] = None, standalone_mode: Literal[True] = True, **extra: object
             ) -> NoReturn: ...

    @overload
    def main(self, args: Optional[Sequence[str]] = None, prog_name: Optional[str] = None,
             complete_var: Optional[str] = None, standalone_mode: bool = True, **extra: object) -> object: ...

    def main(self, args: Optional[Sequence[str]] = None, prog_name: Optional[str] = None,
             complete_var: Optional[str] = None, standalone_mode: bool = True, **extra: object) -> object:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
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
    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    tracker_ignores_hangup()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def tracker_ignores_hangup() -> None:
    """Start multiprocessing's resource tracker with SIGHUP ignored (it inherits that, as it already
    ignores SIGINT and SIGTERM): a hang-up of the process group must leave it there to see the shared
    memory unlinked. Call before anything makes shared memory."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGHUP, previous)


DEFAULTS = DecodeOptions()  # the one source of every decoding default


def with_options(opts: list):
    """A decorator applying click options in the order listed."""
    def apply(f):
        for opt in reversed(opts):
            f = opt(f)
        return f
    return apply


model_options = with_options([  # shared by generate, chat, serve, tune and bench
    click.option("--model", default=None,
                 help="Target: model folder or Hugging Face id [default: the embedded demo pair]."),
    click.option("--draft-model", default=None,
                 help="Draft: MLX model folder, SS draft folder, .mlpackage (macOS) or HF id; 'lookup': "
                      "prompt lookup alone (n-grams of the context, no draft model; sd); 'recycle': the target's "
                      "recycled predictions, verified as a token tree (no draft model; sd)."),
    click.option("--exit-adapter", type=click.Path(dir_okay=False), default=None,
                 help="A learned early-exit adapter for the target (train-exit); 'none' turns off the demo's."),
])


draft_vocab_option = click.option(
    "--draft-vocab", type=int, default=None, metavar="V",
    help="The draft's head scores only the V token ids most frequent in mirror-mlx's shipped text (eos and special "
         "ids always): a cheaper draft step, still lossless (the target verifies every token) [default: the whole "
         "vocabulary].")


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
        click.option("--prefill-step-size", type=int, default=DEFAULTS.prefill_step_size, show_default=True,
                     help="Prompt tokens per target forward in the prefill (as mlx-lm)."),
        # Mirror-SD's knobs
        click.option("--kappa", type=int, default=DEFAULTS.kappa,
                     help="Top-κ width at the early exit [default: the pair's profile's (auto's choice, or the "
                          "best for --mode; uncalibrated: 1)]."),
        click.option("--gamma", "--num-draft-tokens", "gamma", type=int, default=DEFAULTS.gamma,
                     help="Window length γ. --num-draft-tokens is mlx-lm's name for it "
                          "[default: the pair's profile's, as --kappa; uncalibrated: 3]"),
        click.option("--exit-layer", type=int, default=DEFAULTS.exit_layer,
                     help="Early-exit layer ℓ_e [default: the pair's profile's, else the exit adapter's, else N/2]."),
        click.option("--branches", type=int, default=DEFAULTS.branches,
                     help="Branch budget B: mirror rolls out the B branches the early exit scores likeliest of its "
                          "κ(γ+1) a step [default: those that pay, by the generation's own timings]."),
        click.option("--mode", type=click.Choice(CHOICES), default=DEFAULTS.mode, show_default=True,
                     help="auto: the tuned choice for this pair and machine (`mirror-mlx tune`)."),
        # prompt lookup beside the draft (mirror_mlx/proposers/lookup.py)
        click.option("--lookup/--no-lookup", default=DEFAULTS.lookup,
                     help="Propose the context's continuation where an n-gram repeats, the draft model elsewhere "
                          "(sd; mirror: after a fallback) [default: on with --draft-model lookup, else off]."),
        click.option("--ngram-max", type=int, default=DEFAULTS.ngram_max, show_default=True,
                     help="The lookup's longest n-gram, tried first."),
        click.option("--ngram-min", type=int, default=DEFAULTS.ngram_min,
                     help="The lookup's shortest n-gram [default: 1 alone, 2 beside a draft model]."),
    ])


mlx_lm_load_options = with_options([  # mlx_lm.load's flags, for generate and chat
    click.option("--adapter-path", type=click.Path(file_okay=False), default=None,
                 help="LoRA adapters (mlx_lm.lora's folder) applied to the target."),
    click.option("--trust-remote-code", is_flag=True, help="Allow the tokenizer's own code (as mlx-lm)."),
])


pipeline_option = click.option(
    "--pipeline", is_flag=True, help="Under mlx.launch: split the target by layers across ranks (mlx-lm's pipeline "
    "split) where the family has both splits [default: tensor parallel where it has model.shard].")


# the options a refusal names, as flags
FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temp", "top_p": "--top-p", "top_k": "--top-k",
         "min_p": "--min-p", "seed": "--seed", "max_kv_size": "--max-kv-size",
         "prefill_step_size": "--prefill-step-size",
         "kappa": "--kappa", "gamma": "--gamma", "exit_layer": "--exit-layer", "branches": "--branches",
         "mode": "--mode", "lookup": "--lookup", "ngram_max": "--ngram-max", "ngram_min": "--ngram-min",
         "draft_model": "--draft-model", "draft_vocab": "--draft-vocab", "adapter_path": "--adapter-path",
         "prompt_cache": "--prompt-cache-file",
         "mode='ar'": "--mode ar", "mode='sd'": "--mode sd", "lookup=True": "--lookup"}


T = TypeVar("T")


def refusing(error: Union[type[Exception], tuple[type[Exception], ...]], make: Callable[..., T], *args: object,
             **kwargs: object) -> T:
    """`make(*args, **kwargs)`; its own error (bad input, said in one sentence) becomes a one-line usage error."""
    try:
        return make(*args, **kwargs)
    except error as e:
        raise click.UsageError(str(e))


def usage_error(e: Exception) -> click.UsageError:
    """The API's one sentence, naming the options as flags ("temperature must ..." -> "--temp must ...")."""
    return click.UsageError(e.spelled(FLAGS) if isinstance(e, BadOption) else str(e))


def load_pipeline(model, draft_model, exit_adapter, mode: str, adapter_path=None, trust_remote_code=False,
                  tokenizer_config=None, pipeline: bool = False, draft_vocab=None):
    """Load for the CLI: bad paths and mismatched pairs become one-line usage errors. Under mlx.launch
    (more than one rank), every rank loads its shard of the target (mirror_mlx/distributed/)."""
    from mirror_mlx import distributed  # (MLX loads when a verb runs: --help stays fast)
    from mirror_mlx.pipeline import load  # (MLX loads when a verb runs: --help stays fast)

    if distributed.group() is not None:
        verb = click.get_current_context().info_name
        if verb not in ("generate", "chat", "serve", "tune"):
            raise click.UsageError(f"mirror-mlx {verb} runs in one process: under mlx.launch, generate, chat, "
                                   "serve and tune run; start it without the launcher")
        distributed.quiet_other_ranks()
        load = partial(distributed.load, pipeline=pipeline)
        if model is None:  # the demo pair, as below
            model, draft_model = demo_pair.TARGET, demo_pair.DRAFT if draft_model is None else draft_model
            exit_adapter = demo_pair.EXIT_ADAPTER if exit_adapter is None else exit_adapter
    elif pipeline:
        click.echo("mirror-mlx: --pipeline splits the target across the ranks of mlx.launch; one process has "
                   "nothing to split: ignored", err=True)
    if model is None and draft_model is None:
        click.echo("mirror-mlx: no --model given: using the embedded demo pair (stories260K + llama2xs)", err=True)
    elif model is None:
        click.echo(f"mirror-mlx: no --model given: using the embedded demo target (stories260K) with the draft "
                   f"{draft_model}", err=True)
    try:
        return load(model, None if mode == "ar" and model is not None and draft_model is None else draft_model,
                    exit_adapter=exit_adapter, adapter_path=adapter_path, trust_remote_code=trust_remote_code,
                    tokenizer_config=tokenizer_config, draft_vocab=draft_vocab)
    except (ValueError, BadType, FileNotFoundError, RuntimeError) as e:
        raise usage_error(e)


def generation_kwargs(temp, **decode) -> dict:
    """decode_options' flags as the pipeline's keyword arguments (--temp is its temperature)."""
    return dict(decode, temperature=temp)


def xtc_options(min_tokens_to_keep: bool):
    """mlx-lm's XTC flags (generate, chat) and generate's --min-tokens-to-keep: mlx-lm's make_sampler builds the
    sampler from them, a function of the target's distribution like top-p, so every mode stays lossless."""
    opts = [click.option("--xtc-probability", type=float, default=0.0, show_default=True,
                         help="Probability of XTC sampling at each token (as mlx-lm; at --temp > 0)."),
            click.option("--xtc-threshold", type=float, default=0.1, show_default=True,
                         help="XTC removes the tokens above this probability but the least likely of them.")]
    if min_tokens_to_keep:
        opts.append(click.option("--min-tokens-to-keep", type=int, default=1, show_default=True,
                                 help="Minimum tokens min-p sampling keeps (as mlx-lm)."))
    return with_options(opts)


def xtc_sampler(tokenizer, kwargs: dict, xtc_probability: float, xtc_threshold: float, min_tokens_to_keep: int = 1):
    """Put mlx-lm's sampler into `kwargs` when XTC or --min-tokens-to-keep change it (at --temp 0 mlx-lm's is greedy,
    whatever they say); the sampler is mlx_lm.generate's own make_sampler call."""
    from mlx_lm.sample_utils import make_sampler  # (MLX loads when a verb runs: --help stays fast)

    if not 0.0 <= xtc_probability <= 1.0:
        raise click.UsageError(f"--xtc-probability must be in [0, 1] (got {xtc_probability}): 0 turns XTC off")
    if not 0.0 <= xtc_threshold <= 0.5:
        raise click.UsageError(f"--xtc-threshold must be in [0, 0.5] (got {xtc_threshold}), as mlx-lm's XTC requires")
    if min_tokens_to_keep < 1:
        raise click.UsageError(f"--min-tokens-to-keep must be at least 1 (got {min_tokens_to_keep})")
    if kwargs["temperature"] == 0 or (xtc_probability == 0 and min_tokens_to_keep == 1):
        return
    kwargs["sampler"] = make_sampler(kwargs["temperature"], kwargs["top_p"], kwargs["min_p"], min_tokens_to_keep,
                                     kwargs["top_k"], xtc_probability=xtc_probability, xtc_threshold=xtc_threshold,
                                     xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids))


def template_config(text, flag: str = "--chat-template-config"):
    """--chat-template-config (serve: --chat-template-args): a JSON object of extra template variables."""
    if text is None:
        return {}
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise click.UsageError(f"{flag} is not valid JSON ({e.msg}): give an object like "
                               '\'{"enable_thinking": false}\'')
    if not isinstance(config, dict):
        raise click.UsageError(f'{flag} must be a JSON object, like \'{{"enable_thinking": false}}\'')
    return config


def read_prompt(prompt: str) -> str:
    """--prompt: '-' reads stdin; text that is not valid UTF-8 is decoded with U+FFFD, said once."""
    if prompt == "-":
        prompt = sys.stdin.buffer.read().decode("utf-8", "surrogateescape")
    prompt, replaced = clean_text(prompt)
    if replaced:
        click.echo(f"mirror-mlx: note: {REPLACED}", err=True)
    return prompt


