"""The `mirror-mlx` command line: one click group, one small function per verb."""

import sys
from pathlib import Path

import click

import mirror_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(mirror_mlx.__version__, prog_name="mirror-mlx")
def main() -> None:
    """Mirror Speculative Decoding: an MLX target and a draft that run at the same time."""


@main.command("import-llama2c")
@click.argument("checkpoint", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--tokenizer", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The checkpoint's sentencepiece .model file.")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Output MLX model folder.")
def import_llama2c_cmd(checkpoint: Path, tokenizer: Path, out: Path) -> None:
    """Turn a llama2.c CHECKPOINT.bin into an MLX model folder that mlx_lm.load reads."""
    from convert.llama2c import ImportError_, import_llama2c

    try:
        import_llama2c(checkpoint, tokenizer, out)
    except ImportError_ as e:
        raise click.UsageError(str(e))
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
