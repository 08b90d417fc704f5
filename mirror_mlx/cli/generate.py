"""`mirror-mlx generate` and `cache-prompt`: mlx_lm.generate's and mlx_lm.cache_prompt's flags."""

import json
from pathlib import Path
from typing import Optional

import click

from mirror_mlx import demo as demo_pair, prompt_cache, text
from mirror_mlx.blas import status
from mirror_mlx.chunks import kept, result as whole
from mirror_mlx.timeline import Steps, html
from mirror_mlx.cli import (decode_options, draft_vocab_option, generation_kwargs, load_pipeline, mlx_lm_load_options,
                            model_options, pipeline_option, read_prompt, template_config, usage_error, xtc_options,
                            xtc_sampler)
from mirror_mlx.cli.refused import refused_options
from mirror_mlx.loading import load_model
from mirror_mlx.pipeline import check_adapter_path
from mirror_mlx.prompt_cache import read


class TakesLists(click.Command):
    """argparse's nargs="+" for the options in LISTS: `--extra-eos-token a b` is `--extra-eos-token a
    --extra-eos-token b` (values run up to the next argument that starts with '-', as argparse reads them)."""

    LISTS = ("--extra-eos-token", "--image")

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        out: list[str] = []
        current: Optional[str] = None
        for arg in args:
            if arg.startswith("-"):
                current = arg if arg in self.LISTS else None
            elif current is not None and out[-1] != current:
                out.append(current)  # a further value of the same list
            out.append(arg)
        return super().parse_args(ctx, out)


def add_eos_tokens(tokenizer, tokens) -> None:
    for token in tokens:  # mlx-lm would take an unknown string as the unknown-token id; refuse it instead
        try:
            if not token.isdigit() and token not in tokenizer.get_vocab():
                raise ValueError(token)
            tokenizer.add_eos_token(token)
        except ValueError:
            raise click.UsageError(f"--extra-eos-token {token!r} is not a token of this tokenizer: give a token "
                                   "string from its vocabulary or an id")


def read_prompt_cache(path: str, model, decode: dict):
    """--prompt-cache-file: the loaded cache, the model to load and its tokenizer config, as mlx_lm.generate
    takes them from the file's metadata; a file without token ids (mlx_lm.cache_prompt's) turns auto into ar."""
    try:
        cache = read(path)
    except ValueError as e:
        raise click.UsageError(f"--prompt-cache-file: {e}")
    made_with = cache.metadata.get("model")
    if model is not None and made_with is not None and not same_model(model, made_with):
        raise click.UsageError(f"--model {model} is not the model that made --prompt-cache-file ({made_with}): "
                               "drop --model (the file names its model) or make the file again with this one")
    if model is None and made_with is not None and not same_model(made_with, demo_pair.TARGET):
        model = made_with  # as mlx-lm: the file names its model (the demo target: the demo pair, as no --model)
    if cache.tokens is None:
        if decode["mode"] in ("sd", "mirror"):  # refused before a model loads (its layers are checked after)
            try:
                cache.check(decode["mode"], len(cache.cache))
            except ValueError as e:
                raise usage_error(e) from None
        if decode["mode"] == "auto":  # the Pipeline runs ar (stats.why says so)
            click.echo(f"mirror-mlx: {path} holds no prompt token ids (mlx_lm.cache_prompt's file), which the draft "
                       "needs: running --mode ar (`mirror-mlx cache-prompt` makes a file every mode can use)", err=True)
    if decode["max_kv_size"] is not None:
        click.echo("mirror-mlx: --max-kv-size has no effect with --prompt-cache-file (as in mlx-lm): the file's "
                   "cache is used as it is", err=True)
        decode["max_kv_size"] = None
    try:
        tokenizer_config = json.loads(cache.metadata.get("tokenizer_config", "{}"))
    except ValueError:
        raise click.UsageError(f"--prompt-cache-file {path}: its tokenizer_config is not JSON") from None
    return cache, model, tokenizer_config


def same_model(a, b) -> bool:
    """Two --model values naming the same model: equal, or the same local folder."""
    if str(a) == str(b):
        return True
    pa, pb = Path(str(a)).expanduser(), Path(str(b)).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


@click.command("generate", cls=TakesLists)
@model_options
@draft_vocab_option
@mlx_lm_load_options
@click.option("--prompt", "-p", default="Once upon a time", show_default=True, help="Prompt text ('-' reads stdin).")
@click.option("--system-prompt", default=None, help="A system message before the prompt (with a chat template).")
@click.option("--ignore-chat-template", is_flag=True, help="Use the prompt text as is, without the chat template.")
@click.option("--use-default-chat-template", is_flag=True,
              help="Accepted as mlx-lm 0.32 accepts it: it has no effect there either.")
@click.option("--chat-template-config", default=None,
              help='Extra template variables, JSON: \'{"enable_thinking": false}\'.')
@click.option("--extra-eos-token", multiple=True,
              help="Further tokens that end generation: `--extra-eos-token a b`, as mlx-lm (repeatable too).")
@click.option("--prefill-response", default=None,
              help="The reply's start: the chat template's assistant message, which the model continues.")
@click.option("--prompt-cache-file", type=click.Path(dir_okay=False), default=None,
              help="Continue a cached prompt prefix (mirror-mlx cache-prompt's file: every mode; "
                   "mlx_lm.cache_prompt's: --mode ar, which auto then picks).")
@decode_options(max_tokens=100, seed=None)
@xtc_options(min_tokens_to_keep=True)
@click.option("--verbose", default="True", show_default=True, is_flag=False, flag_value="True", metavar="BOOL",
              help="As mlx-lm: 'False' or 'F' prints the text only, anything else streams it and then the timing "
                   "and Mirror-SD stats on stderr.")
@click.option("--quiet", is_flag=True, help="Same as --verbose False.")
@click.option("--kv-group-size", type=int, default=64, show_default=True, expose_value=False,
              help="Accepted as mlx-lm does: it acts only with --kv-bits, which is refused (a quantized KV cache).")
@click.option("--quantized-kv-start", type=int, default=5000, show_default=True, expose_value=False,
              help="Accepted as mlx-lm does: it acts only with --kv-bits, which is refused (a quantized KV cache).")
@pipeline_option
@refused_options("generate")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: tokens, text, stats.")
@click.option("--timeline", type=click.Path(dir_okay=False), default=None,
              help="Write this run's steps as one self-contained HTML file: the target's and the draft's work on "
                   "one time axis, each step's accepted tokens marked in the text.")
def generate_cmd(model, draft_model, draft_vocab, exit_adapter, adapter_path, trust_remote_code, pipeline, prompt,
                 system_prompt, ignore_chat_template, use_default_chat_template, chat_template_config, extra_eos_token,
                 prefill_response, prompt_cache_file, xtc_probability, xtc_threshold, min_tokens_to_keep, verbose,
                 quiet, as_json, timeline, **decode) -> None:
    """Generate from a prompt; prints the text as it is committed, then the stats on stderr.

    mlx_lm.generate's --kv-bits, --image and --quantize-activations are refused, each with its reason
    (docs/mlx-lm-flags.md has every flag).
    """
    verbose = verbose.lower() not in ("false", "f") and not quiet  # mlx_lm.generate's str2bool
    if timeline is not None and not Path(timeline).expanduser().resolve().parent.is_dir():
        raise click.UsageError(f"--timeline {timeline}: its folder does not exist: give a path in an existing folder")
    cache, tokenizer_config = None, None
    if prompt_cache_file is not None:
        cache, model, tokenizer_config = read_prompt_cache(prompt_cache_file, model, decode)
    template_kwargs = template_config(chat_template_config)
    prompt = read_prompt(prompt)
    ar_only = cache is not None and cache.tokens is None  # then no draft is needed
    pipe = load_pipeline(model, draft_model, exit_adapter, "ar" if ar_only else decode["mode"], adapter_path,
                         trust_remote_code, tokenizer_config, pipeline, draft_vocab)
    kwargs = generation_kwargs(**decode)
    try:
        xtc_sampler(pipe.tokenizer, kwargs, xtc_probability, xtc_threshold, min_tokens_to_keep)
        add_eos_tokens(pipe.tokenizer, extra_eos_token)
        if use_default_chat_template:
            click.echo("mirror-mlx: --use-default-chat-template has no effect (as in mlx-lm 0.32)", err=True)
        use_template = not ignore_chat_template and pipe.tokenizer.has_chat_template
        if system_prompt is not None and not use_template:
            click.echo("mirror-mlx: no chat template in use: --system-prompt is ignored (as mlx-lm does)", err=True)
        ids = text.cli_prompt(pipe.tokenizer, prompt, system_prompt, use_template, template_kwargs,
                              cached=cache is not None, prefill_response=prefill_response)
        if as_json and timeline is None:
            result = pipe.generate(ids, prompt_cache=cache, **kwargs)
            click.echo(json.dumps({"tokens": result.tokens, "text": result.text, "stats": result.stats.as_dict()}))
            return
        last, parts, steps, drawn = None, [], Steps(), []
        for last in pipe.stream(ids, prompt_cache=cache, **kwargs):
            parts.append(kept(last))
            drawn.append(steps.add(last.step, last.tokens, last.token_texts, last.from_draft))
            if verbose and not as_json:
                click.echo(last.text, nl=False)
        done = whole(parts, pipe.stats, last.finish_reason if last is not None else "length")
        name = Path(pipe.name).name if Path(pipe.name).exists() else pipe.name
        write_timeline(timeline, drawn, done.text, f"mirror-mlx generate: {name}", pipe.stats.summary())
        if as_json:
            click.echo(json.dumps({"tokens": done.tokens, "text": done.text, "stats": done.stats.as_dict()}))
            return
        click.echo("" if verbose else done.text)  # --quiet: as mlx-lm, the whole text at the end
    except (ValueError, TypeError) as e:
        raise usage_error(e)
    finally:
        pipe.close()
    if verbose and last is not None:
        click.secho(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec\n"
                    f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec\n"
                    f"Peak memory: {last.peak_memory:.3f} GB\n" + pipe.stats.summary() + f" | {status()}",
                    dim=True, err=True)


def write_timeline(path, records: list, text_: str, title: str, summary: str) -> None:
    """--timeline's file (mirror_mlx/timeline.py: the run as one HTML file), and one line on stderr saying so."""
    if path is None:
        return
    try:
        Path(path).expanduser().write_text(html(records, text_, title, summary), encoding="utf-8")
    except OSError as e:
        raise click.UsageError(f"cannot write --timeline {path}: {e.strerror or e}")
    click.echo(f"mirror-mlx: wrote the timeline of {len(records)} steps to {path}", err=True)


@click.command("cache-prompt")
@click.option("--model", default=None,
              help="Target: model folder or Hugging Face id [default: the embedded demo target].")
@mlx_lm_load_options
@click.option("--eos-token", default=None, help="End-of-sequence token for the tokenizer (as mlx_lm.cache_prompt).")
@click.option("--prompt-cache-file", required=True, type=click.Path(dir_okay=False), help="The file to write.")
@click.option("--prompt", "-p", required=True, help="The prefix to cache ('-' reads stdin).")
def cache_prompt_cmd(model, adapter_path, trust_remote_code, eos_token, prompt_cache_file, prompt) -> None:
    """mlx_lm.cache_prompt, plus the prompt's token ids: `generate --prompt-cache-file` then works in every mode."""
    prompt = read_prompt(prompt)
    tokenizer_config = {"trust_remote_code": trust_remote_code}
    if eos_token is not None:
        tokenizer_config["eos_token"] = eos_token
    model = str(demo_pair.TARGET) if model is None else model
    try:
        check_adapter_path(adapter_path)
        target, tokenizer = load_model(model, adapter_path=adapter_path, tokenizer_config=tokenizer_config,
                                       trust_remote_code=trust_remote_code)
        ids = text.cache_prefix(tokenizer, prompt)
        saved = prompt_cache.write(prompt_cache_file, target, ids,
                                   {"model": model, "tokenizer_config": json.dumps(tokenizer_config)})
    except ValueError as e:
        raise usage_error(e)
    except (OSError, RuntimeError) as e:  # MLX reports an unwritable path as a RuntimeError
        raise click.UsageError(f"cannot write --prompt-cache-file {prompt_cache_file}: {e}")
    click.echo(f"wrote {prompt_cache_file}: {saved.length} prompt tokens (mlx_lm.cache_prompt's format plus their "
               "ids: `generate --prompt-cache-file` takes it in every --mode)")


