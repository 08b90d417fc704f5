"""`mirror-mlx serve`: the OpenAI-compatible server (mirror_mlx.server) over one pipeline."""

import click

from mirror_mlx.cli import (DEFAULTS, decode_options, generation_kwargs, load_pipeline, mlx_lm_load_options,
                            model_options, tracker_ignores_hangup)
from mirror_mlx.cli.refused import refused_options


@click.command("serve")
@model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="0 picks a free port.")
@click.option("--max-queue", type=click.IntRange(min=0), default=32, show_default=True,
              help="Requests that may wait while one decodes; more get 429.")
@mlx_lm_load_options
@decode_options(max_tokens=DEFAULTS.max_tokens, seed=None)
@refused_options("serve")
def serve_cmd(model, draft_model, exit_adapter, host, port, max_queue, adapter_path, trust_remote_code, max_tokens, temp,
              **decode) -> None:
    """An OpenAI-compatible server (/v1/chat/completions, /v1/completions) with Mirror-SD behind it.

    mlx_lm.server's other flags (--kv-bits, --decode-concurrency, --chat-template, ...) are refused, each with
    its reason (docs/mlx-lm-flags.md has every flag).
    """
    from mirror_mlx.server import serve

    tracker_ignores_hangup()  # serve() itself stops on SIGHUP as on SIGTERM
    pipe = load_pipeline(model, draft_model, exit_adapter, decode["mode"], adapter_path, trust_remote_code)
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
