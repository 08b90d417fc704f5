"""mlx-lm's flags that mirror-mlx refuses, each with the reason: the commands take them (so the user gets the
reason, not "no such option"), and docs/mlx-lm-flags.md lists the same table (tests/test_flag_parity.py)."""

import click

KV_BITS = ("a quantized KV cache is not supported: mlx-lm quantizes the cache after the forward that reaches "
           "--quantized-kv-start, and a speculative step's forward of several tokens crosses that point where "
           "mlx-lm's one-token forwards do not, so the tokens would differ from mlx-lm's; drop it (a model "
           "quantized in its weights, e.g. mlx-community's -4bit, works in every mode)")
# command -> flag -> (takes a value, why it is refused)
REFUSED = {
    "generate": {
        "--kv-bits": (True, KV_BITS),
        "--image": (True, "mirror-mlx runs text models only: mlx-lm hands images to a vision model's processor, "
                          "which neither the draft nor the verify step reads; drop the flag"),
        "--quantize-activations": (False, "the target runs as mlx_lm.load gives it, and the draft's acceptance "
                                          "was never measured on quantized activations; drop the flag"),
    },
    "chat": {},  # every flag of mlx_lm.chat is taken
    "serve": {
        "--chat-template": (True, "the model's own chat template is used (its tokenizer_config.json); edit it "
                                  "there, or send /v1/completions with the templated text"),
        "--use-default-chat-template": (False, "it has no effect in mlx-lm 0.32 either; drop the flag"),
        "--kv-bits": (True, KV_BITS),
        "--kv-group-size": (True, "only with --kv-bits: " + KV_BITS),
        "--quantized-kv-start": (True, "only with --kv-bits: " + KV_BITS),
    },
}

ALIASES = {"--quantize-activations": ("-qa",)}  # mlx_lm.generate's short names of refused flags


def refused_options(command: str):
    """Hidden options for REFUSED[command]: given, each stops the command with `FLAG is refused: the reason`
    (exit 2)."""
    def refuse(ctx: click.Context, param: click.Parameter, value) -> None:
        if value not in (None, False, ()):
            raise click.UsageError(f"{param.opts[0]} is refused: {REFUSED[command][param.opts[0]][1]}", ctx)

    def apply(f):
        for flag, (takes_value, _) in REFUSED[command].items():
            f = click.option(flag, *ALIASES.get(flag, ()), is_flag=not takes_value, multiple=flag == "--image",
                             hidden=True, expose_value=False, callback=refuse,
                             default=None if takes_value else False)(f)
        return f
    return apply
