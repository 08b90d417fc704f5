"""`mirror-mlx serve`: the OpenAI-compatible server (mirror_mlx.server) over one pipeline."""

import logging
import re

import click

from mirror_mlx.cli import (decode_options, draft_vocab_option, generation_kwargs, load_pipeline, mlx_lm_load_options,
                            model_options, pipeline_option, template_config, tracker_ignores_hangup)
from mirror_mlx.cli.refused import refused_options
from mirror_mlx import distributed
from mirror_mlx.server import serve
from mirror_mlx.server.prefix_cache import PrefixCache

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def origins(text):
    """--allowed-origins: comma-separated origins, '*' for any; None (not given): pages on this machine."""
    if text is None:
        return None
    listed = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    if not listed:
        raise click.UsageError("--allowed-origins is empty: give origins like http://localhost:3000, or '*'")
    return listed


UNITS = {"": 1, "B": 1, **{u + b: 1 << (10 * (i + 1)) for i, u in enumerate("KMGT") for b in ("", "B")}}


def size(text):
    """--prompt-cache-bytes: a byte count with an optional unit (KB, MB, GB, TB: powers of 1024)."""
    if text is None:
        return None

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B?)\s*", text.upper())
    if not m or m.group(2) not in UNITS:
        raise click.UsageError(f"--prompt-cache-bytes {text!r} is not a size: give bytes or e.g. 512MB, 4GB")
    return int(float(m.group(1)) * UNITS[m.group(2)])


def across_ranks(ranks: int, prompt_cache_size: int, prompt_cache_bytes) -> dict:
    """What /health and the start line say of a server across ranks: what it runs differently, and why."""
    if prompt_cache_size == 0:
        prefix = "off (--prompt-cache-size 0)"
    elif prompt_cache_bytes is not None:
        prefix = ("off across ranks under --prompt-cache-bytes: each rank would drop entries by its own shard's "
                  "bytes, and the ranks must restore the same entry; the engine's own cache still serves the last "
                  "request's prefix")
    else:
        prefix = (f"on: up to {prompt_cache_size} entries on every rank (its shard's keys and values), restored "
                  "and stored at the same requests on every rank")
    return {"ranks": ranks,
            "batching": "off across ranks: one request decodes at a time, the others wait in the queue "
                        "(mlx-lm's BatchGenerator runs in one process)",
            "prefix_cache_across_requests": prefix}


@click.command("serve")
@model_options
@draft_vocab_option
@mlx_lm_load_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="0 picks a free port.")
@click.option("--max-queue", type=click.IntRange(min=0), default=32, show_default=True,
              help="Requests that may wait while others decode; more get 429.")
@click.option("--allowed-origins", default=None,
              help="Browser origins that may call the server, comma-separated ('*': any) [default: pages on this "
                   "machine only: http(s)://localhost, 127.0.0.1, [::1], any port].")
@click.option("--chat-template-args", default=None,
              help='A JSON object of chat template arguments, e.g. \'{"enable_thinking": false}\' (as mlx_lm.server).')
@click.option("--prompt-cache-size", type=click.IntRange(min=0), default=10, show_default=True,
              help="Target caches of recent prompts kept, so a prefix sent again is not prefilled again (0: off).")
@click.option("--prompt-cache-bytes", default=None,
              help="At most this much memory for those caches and the active batch's together, e.g. 4GB or 512MB "
                   "(as mlx_lm.server) [default: no limit].")
@click.option("--decode-concurrency", type=click.IntRange(min=1), default=32, show_default=True,
              help="Requests that decode together in one batch (as mlx_lm.server); 1: one at a time.")
@click.option("--prompt-concurrency", type=click.IntRange(min=1), default=8, show_default=True,
              help="Prompts prefilled together when requests join the batch (as mlx_lm.server).")
@click.option("--batch-speculation", type=click.Choice(["on", "off"]), default="on", show_default=True,
              help="When requests decode together, each row verifies its own prompt-lookup window in the batch's "
                   "one forward, at the width that pays (off: one token a row per step, as mlx_lm.server).")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False), default="INFO", show_default=True,
              help="WARNING and above: no line per request.")
@decode_options(max_tokens=512, seed=None)
@pipeline_option
@refused_options("serve")
def serve_cmd(model, draft_model, draft_vocab, exit_adapter, adapter_path, trust_remote_code, pipeline, host, port,
              max_queue, allowed_origins, chat_template_args, prompt_cache_size, prompt_cache_bytes, decode_concurrency,
              prompt_concurrency, batch_speculation, log_level, max_tokens,
              temp, **decode) -> None:
    """An OpenAI-compatible server (/v1/chat/completions, /v1/completions) with Mirror-SD behind it."""
    allowed = origins(allowed_origins)
    template_kwargs = template_config(chat_template_args, "--chat-template-args")
    cache_bytes = size(prompt_cache_bytes)
    tracker_ignores_hangup()  # serve() itself stops on SIGHUP as on SIGTERM
    pipe = load_pipeline(model, draft_model, exit_adapter, decode["mode"], adapter_path=adapter_path,
                         trust_remote_code=trust_remote_code, pipeline=pipeline, draft_vocab=draft_vocab)
    pipe.chat_template_kwargs = template_kwargs
    defaults = generation_kwargs(temp, **decode)
    g, across, on_signal = distributed.group(), None, None
    try:
        pipe.check([0], **dict(defaults, max_tokens=1))
        if g is not None:  # under mlx.launch: rank 0 serves, the other ranks follow it step by step
            across = across_ranks(g.size(), prompt_cache_size, cache_bytes)
            if cache_bytes is not None:
                prompt_cache_size = 0
            if g.rank() > 0:
                prefixes = PrefixCache(pipe.engine, prompt_cache_size) if prompt_cache_size else None
                distributed.serve_follower(pipe, prefixes)
                return
            pipe.lead()
            distributed.end_with_launcher()
            decode_concurrency, on_signal = 1, distributed.stop_within_grace
        serve(pipe, host, port, defaults, max_tokens=max_tokens, max_queue=max_queue, allowed_origins=allowed,
              log_level=getattr(logging, log_level.upper()), prompt_cache_size=prompt_cache_size,
              prompt_cache_bytes=cache_bytes, decode_concurrency=decode_concurrency,
              prompt_concurrency=prompt_concurrency, across=across, on_signal=on_signal,
              batch_speculation=batch_speculation == "on")
    except ValueError as e:
        raise click.UsageError(str(e))
    except OSError as e:
        raise click.UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}: pick another --port")
    finally:
        pipe.close()
