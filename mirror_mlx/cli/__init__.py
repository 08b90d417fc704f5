"""The `mirror-mlx` command line: one click group; each group of verbs is a small module, imported
only when one of its verbs runs (so `generate` never loads coremltools or the trainers)."""

import importlib
import sys

import click

import mirror_mlx

VERBS = {  # verb -> "module:command"; the order `--help` lists them in
    "generate": "mirror_mlx.cli.generate:generate_cmd",
    "cache-prompt": "mirror_mlx.cli.generate:cache_prompt_cmd",
    "chat": "mirror_mlx.cli.chat:chat_cmd",
    "serve": "mirror_mlx.cli.serve:serve_cmd",
    "tune": "mirror_mlx.cli.measure:tune_cmd",
    "bench": "mirror_mlx.cli.measure:bench_cmd",
    "omega": "mirror_mlx.cli.measure:omega_cmd",
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
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=Verbs, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(mirror_mlx.__version__, prog_name="mirror-mlx")
def main() -> None:
    """Mirror Speculative Decoding: an MLX target and a draft that run at the same time."""
