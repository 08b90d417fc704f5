"""The `mirror-mlx` command line: one click group, one small function per verb."""

import re
import sys
from pathlib import Path
from typing import Optional

import click

import mirror_mlx
from mirror_mlx.options import CHOICES, PAPER_KNOBS, DecodeOptions

DEFAULTS = DecodeOptions()  # the one source of every decoding default


class OneLineErrors(click.Group):
    """Usage errors print one line (`mirror-mlx VERB: error: ...`) and exit 2, with no usage block."""

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
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(mirror_mlx.__version__, prog_name="mirror-mlx")
def main() -> None:
    """Mirror Speculative Decoding: an MLX target and a draft that run at the same time."""


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
                     help=f"Top-κ width at the early exit [default: auto's, else {PAPER_KNOBS['kappa']}]."),
        click.option("--gamma", type=int, default=DEFAULTS.gamma,
                     help=f"{gamma_help} [default: auto's, else {PAPER_KNOBS['gamma']}]"),
        click.option("--exit-layer", type=int, default=DEFAULTS.exit_layer,
                     help="Early-exit layer ℓ_e [default: auto's, else the exit adapter's, else N/2]."),
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


def add_eos_tokens(tokenizer, tokens) -> None:
    for token in tokens:  # mlx-lm would take an unknown string as the unknown-token id; refuse it instead
        try:
            if not token.isdigit() and token not in tokenizer.get_vocab():
                raise ValueError(token)
            tokenizer.add_eos_token(token)
        except ValueError:
            raise click.UsageError(f"--extra-eos-token {token!r} is not a token of this tokenizer: give a token "
                                   "string from its vocabulary or an id")


def prompt_ids(tokenizer, prompt: str, system_prompt, ignore_chat_template: bool, template_kwargs: dict,
               after_cache: bool = False) -> list:
    """The prompt as mlx_lm.generate builds it: through the chat template unless there is none or it is ignored.

    `after_cache` (--prompt-cache-file): as mlx-lm, only the templated text from the user message's
    content on, since the cached prefix (mlx_lm.cache_prompt's open user message) holds what precedes it.
    """
    prompt = prompt.replace("\\n", "\n").replace("\\t", "\t")
    use_template = not ignore_chat_template and tokenizer.has_chat_template
    if not use_template:
        if system_prompt is not None:
            click.echo("mirror-mlx: no chat template in use: --system-prompt is ignored (as mlx-lm does)", err=True)
        return list(tokenizer.encode(prompt))
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    messages.append({"role": "user", "content": prompt})
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    except Exception as e:  # a template raises for roles it does not know (say, no system role)
        raise click.UsageError(f"the model's chat template refused the prompt ({e}): drop --system-prompt or "
                               "use --ignore-chat-template")
    if after_cache:  # mlx-lm's rule, template variables left out of the probe as mlx-lm leaves them
        probe = tokenizer.apply_chat_template(messages[:-1] + [{"role": "user", "content": "<query>"}],
                                              tokenize=False, add_generation_prompt=True)
        text = text[probe.index("<query>"):]
    return list(tokenizer.encode(text, add_special_tokens=False))


def read_prompt(prompt: str) -> str:
    """--prompt: '-' reads stdin; text that is not valid UTF-8 is decoded with U+FFFD, said once."""
    from mirror_mlx.validate import REPLACED, clean_text

    if prompt == "-":
        prompt = sys.stdin.buffer.read().decode("utf-8", "surrogateescape")
    prompt, replaced = clean_text(prompt)
    if replaced:
        click.echo(f"mirror-mlx: note: {REPLACED}", err=True)
    return prompt


def read_prompt_cache(path: str, model, decode: dict):
    """--prompt-cache-file: the loaded cache, the model to load and its tokenizer config, as mlx_lm.generate
    takes them from the file's metadata; a file without token ids (mlx_lm.cache_prompt's) turns auto into ar."""
    import json

    from mirror_mlx import demo_pair
    from mirror_mlx.prompt_cache import read

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
        if decode["mode"] in ("sd", "mirror"):
            raise click.UsageError(
                f"--mode {decode['mode']} needs the cached prompt's token ids (the draft reads them), and "
                f"--prompt-cache-file {path} has none (mlx_lm.cache_prompt's file): make it with `mirror-mlx "
                "cache-prompt` (mlx-lm's format plus the ids), or use --mode ar")
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


@main.command("generate")
@model_options
@mlx_lm_load_options
@click.option("--prompt", "-p", default="Once upon a time", show_default=True, help="Prompt text ('-' reads stdin).")
@click.option("--system-prompt", default=None, help="A system message before the prompt (with a chat template).")
@click.option("--ignore-chat-template", is_flag=True, help="Use the prompt text as is, without the chat template.")
@click.option("--use-default-chat-template", is_flag=True,
              help="Accepted as mlx-lm 0.32 accepts it: it has no effect there either.")
@click.option("--chat-template-config", default=None, help='Extra template variables, JSON: \'{"enable_thinking": false}\'.')
@click.option("--extra-eos-token", multiple=True, help="Another token that ends generation (repeatable).")
@click.option("--prompt-cache-file", type=click.Path(dir_okay=False), default=None,
              help="Continue a cached prompt prefix (mirror-mlx cache-prompt's file: every mode; "
                   "mlx_lm.cache_prompt's: --mode ar, which auto then picks).")
@decode_options(max_tokens=100, seed=None)
@click.option("--verbose/--quiet", default=True, show_default=True,
              help="Stream the text, then the timing and Mirror-SD stats on stderr; --quiet prints the text only.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: tokens, text, stats.")
def generate_cmd(model, draft_model, exit_adapter, adapter_path, trust_remote_code, prompt, system_prompt,
                 ignore_chat_template, use_default_chat_template, chat_template_config, extra_eos_token,
                 prompt_cache_file, verbose, as_json, **decode) -> None:
    """Generate from a prompt; prints the text as it is committed, then the stats on stderr."""
    import json

    from mirror_mlx.blas import status

    cache, tokenizer_config = None, None
    if prompt_cache_file is not None:
        cache, model, tokenizer_config = read_prompt_cache(prompt_cache_file, model, decode)
    template_kwargs = template_config(chat_template_config)
    prompt = read_prompt(prompt)
    ar_only = cache is not None and cache.tokens is None  # then no draft is needed
    pipe = load_pipeline(model, draft_model, exit_adapter, "ar" if ar_only else decode["mode"], adapter_path,
                         trust_remote_code, tokenizer_config)
    kwargs = generation_kwargs(**decode)
    try:
        add_eos_tokens(pipe.tokenizer, extra_eos_token)
        if use_default_chat_template:
            click.echo("mirror-mlx: --use-default-chat-template has no effect (as in mlx-lm 0.32)", err=True)
        ids = prompt_ids(pipe.tokenizer, prompt, system_prompt, ignore_chat_template, template_kwargs,
                         after_cache=cache is not None)
        pipe.check(ids, prompt_cache=cache, **kwargs)
        if as_json:
            result = pipe.generate(ids, prompt_cache=cache, **kwargs)
            click.echo(json.dumps({"tokens": result.tokens, "text": result.text, "stats": result.stats.as_dict()}))
            return
        last, text = None, []
        for last in pipe.stream(ids, prompt_cache=cache, **kwargs):
            text.append(last.text)
            if verbose:
                click.echo(last.text, nl=False)
        click.echo("" if verbose else "".join(text))  # --quiet: as mlx-lm, the whole text at the end
    except (ValueError, TypeError) as e:
        raise usage_error(e)
    finally:
        pipe.close()
    if verbose and last is not None:
        click.secho(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec\n"
                    f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec\n"
                    f"Peak memory: {last.peak_memory:.3f} GB\n" + pipe.stats.summary() + f" | {status()}",
                    dim=True, err=True)


@main.command("cache-prompt")
@click.option("--model", default=None, help="Target: model folder or Hugging Face id [default: the embedded demo target].")
@mlx_lm_load_options
@click.option("--eos-token", default=None, help="End-of-sequence token for the tokenizer (as mlx_lm.cache_prompt).")
@click.option("--prompt-cache-file", required=True, type=click.Path(dir_okay=False), help="The file to write.")
@click.option("--prompt", "-p", required=True, help="The prefix to cache ('-' reads stdin).")
def cache_prompt_cmd(model, adapter_path, trust_remote_code, eos_token, prompt_cache_file, prompt) -> None:
    """mlx_lm.cache_prompt, plus the prompt's token ids: `generate --prompt-cache-file` then works in every mode."""
    import json

    from mirror_mlx import demo_pair, prompt_cache
    from mirror_mlx.loading import load_model
    from mirror_mlx.pipeline import check_adapter_path

    prompt = read_prompt(prompt)
    tokenizer_config = {"trust_remote_code": trust_remote_code}
    if eos_token is not None:
        tokenizer_config["eos_token"] = eos_token
    model = str(demo_pair.TARGET) if model is None else model
    try:
        check_adapter_path(adapter_path)
        target, tokenizer = load_model(model, adapter_path=adapter_path, tokenizer_config=tokenizer_config,
                                       trust_remote_code=trust_remote_code)
        ids = prompt_cache.prompt_ids(tokenizer, prompt)
        saved = prompt_cache.write(prompt_cache_file, target, ids,
                                   {"model": model, "tokenizer_config": json.dumps(tokenizer_config)})
    except ValueError as e:
        raise usage_error(e)
    except (OSError, RuntimeError) as e:  # MLX reports an unwritable path as a RuntimeError
        raise click.UsageError(f"cannot write --prompt-cache-file {prompt_cache_file}: {e}")
    click.echo(f"wrote {prompt_cache_file}: {saved.length} prompt tokens (mlx_lm.cache_prompt's format plus their "
               "ids: `generate --prompt-cache-file` takes it in every --mode)")


@main.command("chat")
@model_options
@mlx_lm_load_options
@click.option("--system-prompt", default=None, help="A system message that opens the conversation.")
@click.option("--chat-template-config", default=None, help='Extra template variables, JSON: \'{"enable_thinking": false}\'.')
@decode_options(max_tokens=256, seed=0)
def chat_cmd(model, draft_model, exit_adapter, adapter_path, trust_remote_code, system_prompt, chat_template_config,
             **decode) -> None:
    """Chat: replies stream as they are committed, earlier turns stay cached; /help lists the commands."""
    from mirror_mlx.chat import run_chat

    template_kwargs = template_config(chat_template_config)
    pipe = load_pipeline(model, draft_model, exit_adapter, decode["mode"], adapter_path, trust_remote_code)
    pipe.chat_template_kwargs = template_kwargs
    kwargs = generation_kwargs(**decode)
    try:
        pipe.check([0], **dict(kwargs, max_tokens=min(kwargs["max_tokens"], 1)))  # a turn's length is capped
        code = run_chat(pipe, kwargs, system_prompt)
    except (ValueError, TypeError) as e:
        raise usage_error(e)
    finally:
        pipe.close()
    sys.exit(code)


@main.command("serve")
@model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="0 picks a free port.")
@click.option("--max-queue", type=click.IntRange(min=0), default=32, show_default=True,
              help="Requests that may wait while one decodes; more get 429.")
@decode_options(max_tokens=DEFAULTS.max_tokens, seed=None)
def serve_cmd(model, draft_model, exit_adapter, host, port, max_queue, max_tokens, temp, **decode) -> None:
    """An OpenAI-compatible server (/v1/chat/completions, /v1/completions) with Mirror-SD behind it."""
    from mirror_mlx.server import serve

    pipe = load_pipeline(model, draft_model, exit_adapter, decode["mode"])
    defaults = generation_kwargs(max_tokens, temp, **decode)
    defaults.pop("max_tokens")
    try:
        pipe.check([0], **dict(defaults, max_tokens=1))
        serve(pipe, host, port, defaults, max_tokens=max_tokens, max_queue=max_queue)
    except ValueError as e:
        raise click.UsageError(str(e))
    except OSError as e:
        raise click.UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}: pick another --port")
    finally:
        pipe.close()


@main.command("tune")
@model_options
@click.option("--prompts", "prompts_file", default=None,
              help="Calibration prompts: FILE.jsonl (a 'prompt' or 'turns' field per line) or a prompt set name "
                   "[default: held-out TinyStories openings].")
@click.option("--limit", type=click.IntRange(min=1), default=4, show_default=True, help="Calibration prompts.")
@click.option("--max-tokens", "-m", type=click.IntRange(min=4), default=48, show_default=True,
              help="Greedy tokens per calibration prompt.")
@click.option("--confirm", type=click.IntRange(min=1), default=5, show_default=True,
              help="Top predictions to measure end to end.")
@click.option("--min-seconds", type=click.FloatRange(min=0), default=4.0, show_default=True,
              help="Each configuration run for real goes round its prompts until it has decoded this long.")
@click.option("--quick", is_flag=True, help="The few-second calibration that mode=auto runs on first use.")
@click.option("--pin", is_flag=True, help="Pin the target side to one core and the draft to another, as "
              "`bench --pin` does (Linux; set OPENBLAS_NUM_THREADS=1 too): calibrate as the bench runs.")
def tune_cmd(model, draft_model, exit_adapter, prompts_file, limit, max_tokens, confirm, min_seconds, quick,
             pin) -> None:
    """Measure this machine, predict every (mode, κ, γ, ℓe), confirm the best and save the profile auto uses."""
    from mirror_mlx import profile, tune
    from mirror_mlx.bench_machine import pin_threads
    from mirror_mlx.compute_plan import report as compute_plan_report

    pipe = load_pipeline(model, draft_model, exit_adapter, "auto")
    if pin:
        pinning = pin_threads(pipe)
        click.echo(f"pinning: {pinning}", err=True)
    cfg = tune.TuneConfig.quick() if quick else tune.TuneConfig(prompts=limit, max_tokens=max_tokens, confirm=confirm,
                                                                min_seconds=min_seconds)
    if quick:
        cfg.progress = True
    try:
        prof = tune.calibrate(pipe, cfg, prompts_file)
    except ValueError as e:
        raise click.UsageError(str(e))
    finally:
        pipe.close()
    path = profile.save(prof)
    click.echo(tune.format_table(prof))
    for line in (tune.contention(prof), tune.acceptance_line(prof), compute_plan_report(draft_model)):
        if line:
            click.echo(line)
    click.echo(f"chose {tune.describe(prof)}: {prof.why}")
    split = ", ".join(f"{k} {v:.0f} s" for k, v in prof.calibration.get("phases", {}).items())
    click.echo(f"calibrated in {prof.calibration['seconds']:.0f} s ({split}) on {prof.key['machine']}; wrote {path}")


@main.command("import-llama2c")
@click.argument("checkpoint", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--tokenizer", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The checkpoint's sentencepiece .model file.")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Output MLX model folder.")
def import_llama2c_cmd(checkpoint: Path, tokenizer: Path, out: Path) -> None:
    """Turn a llama2.c CHECKPOINT.bin into an MLX model folder that mlx_lm.load reads."""
    from mirror_mlx.convert.llama2c import ImportError_, import_llama2c

    try:
        import_llama2c(checkpoint, tokenizer, out)
    except ImportError_ as e:
        raise click.UsageError(str(e))
    click.echo(f"wrote {out}")


@main.command("widen")
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The mlx-lm model folder to widen (llama, mistral, qwen2, qwen3).")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Output MLX model folder.")
@click.option("--hidden", required=True, type=int, help="New hidden size.")
@click.option("--heads", required=True, type=int, help="New number of attention heads (head_dim is kept).")
@click.option("--intermediate", required=True, type=int, help="New MLP width.")
@click.option("--layers", required=True, type=int, help="New number of layers (identity layers are added).")
@click.option("--kv-heads", type=int, default=None, help="New number of kv heads [default: keep the ratio].")
def widen_cmd(model_dir: Path, out: Path, hidden: int, heads: int, intermediate: int, layers: int,
              kv_heads: int | None) -> None:
    """Write a wider, deeper copy of a model that computes the same logits (for cost-realistic benchmarks)."""
    from mirror_mlx.convert.widen import WidenError, widen

    try:
        widen(model_dir, out, hidden, heads, intermediate, layers, kv_heads)
    except WidenError as e:
        raise click.UsageError(str(e))
    click.echo(f"wrote {out}")


@main.command("widen-exit")
@click.option("--exit-adapter", "adapter", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The small target's exit adapter (train-exit).")
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The small target it was trained for.")
@click.option("--widened", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The target's widened copy (mirror-mlx widen --model ...).")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Output .safetensors.")
def widen_exit_cmd(adapter: Path, model_dir: Path, widened: Path, out: Path) -> None:
    """Widen an exit adapter along with its target: exact at the widened layers that hold its layer's state."""
    from mirror_mlx.convert.widen import WidenError, widen_adapter

    for p, what in ((adapter, "--exit-adapter"), (model_dir / "config.json", "--model"), (widened / "config.json", "--widened")):
        if not p.is_file():
            raise click.UsageError(f"{what}: {p} does not exist")
    try:
        layers = widen_adapter(adapter, model_dir, widened, out)
    except WidenError as e:
        raise click.UsageError(str(e))
    click.echo(f"wrote {out} (exact at exit layers {', '.join(map(str, layers))})")


@main.command("train-draft")
@click.option("--model", required=True, help="The target (model folder or Hugging Face repo) to distil from.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output draft folder (resumes if it holds a checkpoint).")
@click.option("--corpus", required=True, type=click.Path(), help="UTF-8 text file; blank lines separate paragraphs.")
@click.option("--layers", type=int, default=None, help="Draft layers [default: --init-from's, else half the target's].")
@click.option("--hidden", type=int, default=None, help="Draft width [default: --init-from's, else the target's].")
@click.option("--streams", type=int, default=3, show_default=True, help="Lookahead streams (tokens per forward - 1).")
@click.option("--stream-layers", type=int, default=2, show_default=True, help="Top layers that carry the streams.")
@click.option("--steps", type=int, default=2000, show_default=True)
@click.option("--batch-size", type=int, default=32, show_default=True)
@click.option("--lr", type=float, default=2e-3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--init-from", type=click.Path(file_okay=False), default=None,
              help="Start from this small model's weights (it must share the target's tokenizer).")
@click.option("--samples", type=int, default=2048, show_default=True, help="Target continuations to train on.")
@click.option("--seq-len", type=int, default=128, show_default=True, help="Opening + continuation length.")
@click.option("--holdout", type=int, default=None,
              help="Leave the corpus's first N paragraphs out of training (benchmark openings) "
                   "[default: as the one corpus split, corpus.py].")
def train_draft_cmd(**kwargs) -> None:
    """Distil a Speculative-Streaming draft from the target's own greedy text."""
    from mirror_mlx.ane_draft.train import TrainConfig, TrainError, train

    try:
        summary = train(TrainConfig(**{k: v for k, v in kwargs.items() if v is not None}))
    except TrainError as e:
        raise click.UsageError(str(e))
    after = summary["val_after"]
    click.echo(f"wrote {kwargs['out']}: held-out main acc {after['main_acc']:.3f}, "
               f"stream acc {after['stream_acc']}, {summary['train_s']:.0f} s")


from mirror_mlx.convert.command import convert_cmd  # noqa: E402  (ANE draft packages: convert/coreml.py)

main.add_command(convert_cmd)


@main.command("train-exit")
@click.option("--model", default=None, help="Target model folder or Hugging Face id [default: the embedded demo target].")
@click.option("--exit-layer", type=int, default=None, help="Blocks before the early exit, l_e [default: N//2].")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Adapter file to write (.safetensors).")
@click.option("--rank", type=click.IntRange(min=1), default=256, show_default=True, help="Adapter hidden width.")
@click.option("--linear", is_flag=True, help="A low-rank linear map instead of the residual MLP (weaker, cheaper).")
@click.option("--corpus", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Text, paragraphs split by blank lines; trains on the target's greedy text after each "
                   "paragraph's first sentence [default, for the demo target only: the packaged TinyStories sample].")
@click.option("--steps", type=click.IntRange(min=1), default=6000, show_default=True)
@click.option("--tokens", type=click.IntRange(min=1), default=None,
              help="Budget for the text phase: at most this many tokens of the target's greedy text to train on "
                   "(64 per opening; held-out a tenth) [default: every opening of the corpus].")
@click.option("--seed", type=int, default=0, show_default=True)
def train_exit_cmd(model: str | None, exit_layer: int | None, out: Path, rank: int, linear: bool,
                   corpus: Path | None, steps: int, tokens: int | None, seed: int) -> None:
    """Distil an early-exit adapter: the target's head at layer l_e learns the final distribution."""
    from mirror_mlx.exit_adapter import train_and_save

    try:
        r = train_and_save(out, model, exit_layer, corpus, rank=rank, mlp=not linear, steps=steps, seed=seed,
                           tokens=tokens)
    except ValueError as e:
        raise click.UsageError(str(e))
    click.echo(f"wrote {out}: layer {r.exit_layer}, held-out KL {r.kl_before:.3f} -> {r.kl_after:.3f} nats "
               f"({r.train_rows} training rows, {r.seconds:.0f} s)")


@main.command("omega")
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
    from mirror_mlx.omega import run_omega

    try:
        click.echo(run_omega(model, draft_model, exit_adapters, prompts, max_tokens, layers or None))
    except ValueError as e:
        raise click.UsageError(str(e))


@main.command("bench")
@model_options
@click.option("--prompts", default="tinystories", show_default=True,
              help="tinystories, spec_bench, mt_bench or FILE.jsonl (a 'prompt' or 'turns' field per line).")
@click.option("--limit", type=click.IntRange(min=1), default=10, show_default=True, help="Prompts to run.")
@click.option("--skip", type=click.IntRange(min=0), default=0, show_default=True,
              help="Leave out the first N prompts (e.g. those a sweep chose the knobs on).")
@click.option("--max-tokens", "-m", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--modes", default="mirror,sd,mlx_sd,ar", show_default=True,
              help="Comma-separated: mirror, sd (ours), mlx_sd, ar (mlx-lm's own), auto (the tuned choice); "
                   "ar always runs as reference.")
@click.option("--temp", type=float, default=DEFAULTS.temperature, show_default=True, help="Sampling temperature.")
@click.option("--kappa", type=int, default=PAPER_KNOBS["kappa"], show_default=True, help="Top-κ width at the early exit.")
@click.option("--gamma", type=int, default=PAPER_KNOBS["gamma"], show_default=True, help="Window length γ (mirror and sd).")
@click.option("--exit-layer", type=int, default=DEFAULTS.exit_layer,
              help="Early-exit layer ℓ_e [default: the exit adapter's, else N/2].")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of prompt i is seed + i.")
@click.option("--sweep", default=None,
              help='Instead of the mode comparison, mirror over a grid, e.g. "kappa=1,4,8,16 gamma=3,5,7 '
                   'exit=N/4,N/2,3N/4".')
@click.option("--pin", is_flag=True, help="Pin the target side to one core and the draft to another "
              "(Linux; set OPENBLAS_NUM_THREADS=1 too).")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder for results.json, results.md and the plots.")
def bench_cmd(**kwargs) -> None:
    """Mirror-SD against mlx-lm's generate_step and speculative decoding, same prompts, one process."""
    from mirror_mlx.bench import BenchConfig, Mismatch, bench

    try:
        report = bench(BenchConfig(**kwargs))
    except Mismatch as e:
        raise click.ClickException(f"{e} (partial results in {kwargs['out']}/results.json)")
    except ValueError as e:
        raise click.UsageError(str(e))
    click.echo((kwargs["out"] / "results.md").read_text())
    if report.get("best"):
        click.echo(f"best sweep point: {report['best']['name']}")


@main.command("doctor")
@click.option("--model", default=None, help="Target for the overlap probe [default: the embedded demo pair].")
@click.option("--draft-model", default=None, help="Draft; a .mlpackage also gets its Core ML compute plan.")
@click.option("--seconds", type=click.FloatRange(min=0.5), default=2.0, show_default=True, help="Overlap probe length.")
def doctor_cmd(model: str | None, draft_model: str | None, seconds: float) -> None:
    """What this machine can do: OS, chip, Python, MLX, Core ML, and a target ‖ draft overlap probe."""
    from mirror_mlx.doctor import report

    for line in report(model, draft_model, seconds):
        click.echo(line)


if __name__ == "__main__":
    sys.exit(main())
