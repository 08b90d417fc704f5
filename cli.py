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
    from convert.widen import WidenError, widen

    try:
        widen(model_dir, out, hidden, heads, intermediate, layers, kv_heads)
    except WidenError as e:
        raise click.UsageError(str(e))
    click.echo(f"wrote {out}")


from convert.command import convert_cmd  # noqa: E402  (ANE draft packages: convert/coreml.py)

main.add_command(convert_cmd)


if __name__ == "__main__":
    sys.exit(main())
