"""`mirror-mlx distill data|train|measure`: a draft of the target's first layers with a trimmed head,
distilled from the target's own replies (mirror_mlx/train/distill.py)."""

import json
from pathlib import Path

import click
from mirror_mlx.loading import mlx_lm_load as load

from mirror_mlx.cli import refusing
from mirror_mlx.drafts.distilled.model_types import load_model
from mirror_mlx.train.distill import (DataConfig, TrainConfig, agreement_by_category, cost_ratio, data_root,
                                      generate_data, loop, read_reply_files, train)
from mirror_mlx.train.distill_data import pack_ids, read_questions, restore_ids
from mirror_mlx.train.questions import write_questions
from mirror_mlx.prompts import spec_bench_part


def target_folder(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """The --model folder, refused in one sentence unless it holds an mlx-lm model (config.json)."""
    if not (Path(value) / "config.json").is_file():
        raise click.BadParameter(f"{value} is not an mlx-lm model folder (no config.json): give the target's folder, "
                                 "e.g. build/real-pair/target from `mirror-mlx real-pair`", param_hint="--model")
    return value


target_option = click.option("--model", required=True, callback=target_folder, help="The target's mlx-lm folder.")


@click.group("distill")
def distill_cmd() -> None:
    """Distil a cut-down draft (first layers + trained layers + trimmed head) from a chat target."""


@distill_cmd.command("data")
@target_option
@click.option("--data-dir", default=None, help="Where replies are cached [default: CACHE/distill/<target>].")
@click.option("--max-tokens", type=int, default=DataConfig.max_tokens, show_default=True, help="Longest reply.")
@click.option("--batch-size", type=int, default=DataConfig.batch_size, show_default=True, help="Rows decoded together.")
@click.option("--rounds", type=int, default=DataConfig.rounds, show_default=True,
              help="Sampled rounds (T=0.7 and T=1.0, a new seed each) after the first.")
@click.option("--tinystories", type=int, default=DataConfig.tinystories, show_default=True,
              help="TinyStories openings (training part of the corpus) asked for a story.")
@click.option("--minutes", type=float, default=None, help="Stop after this long (run again to go on).")
@click.option("--ids", "ids", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A file `distill pack` wrote: its replies count as made, so another machine's work is not redone.")
@click.option("--questions", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A file `distill questions` wrote: the target's own questions, replied to as the source `self`.")
def data_cmd(model, data_dir, max_tokens, batch_size, rounds, tinystories, minutes, ids, questions) -> None:
    """Generate (or go on generating) the target's replies: every reply is saved as it is made, so a killed
    run continues where it stopped."""
    cfg = DataConfig(target=model, data_dir=data_dir, max_tokens=max_tokens, batch_size=batch_size, rounds=rounds,
                     tinystories=tinystories, ids=ids, questions=questions)
    if questions is not None:
        refusing(ValueError, read_questions, Path(questions))  # a file that is no questions file: one sentence
    r = generate_data(cfg, log=lambda s: click.echo(s, err=True),
                      stop_after_s=None if minutes is None else minutes * 60)
    click.echo(json.dumps(r))


@distill_cmd.command("questions")
@target_option
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="The questions file (.jsonl), grown.")
@click.option("--count", type=int, required=True, help="Questions the file holds when done.")
@click.option("--batch-size", type=int, default=64, show_default=True, help="Samples drawn together.")
def questions_cmd(model, out, count, batch_size) -> None:
    """Have the target write user questions (sampled from the opening of a user turn), new ones only, until OUT
    holds COUNT; the evaluation part's questions are never kept. Resumable: it goes on from OUT's last seed."""
    target, tokenizer = load(model)
    exclude = [p.text for p in spec_bench_part("eval")]
    r = refusing(ValueError, write_questions, target, tokenizer, Path(out), count, batch_size, exclude=exclude,
                 log=lambda s: click.echo(s, err=True))
    click.echo(json.dumps(r))


@distill_cmd.command("pack")
@target_option
@click.option("--data-dir", default=None, help="The reply cache [default: CACHE/distill/<target>].")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="The ids file to write (.npz).")
def pack_cmd(model, data_dir, out) -> None:
    """Keep the cached replies as token ids only, in one compact file a repository can hold: another machine
    restores the cache from it (`distill restore`) or goes on generating past it (`distill data --ids`). An
    existing file's replies the cache lacks are kept."""
    click.echo(json.dumps(pack_ids(data_root(model, data_dir), Path(out))))


@distill_cmd.command("restore")
@target_option
@click.option("--ids", "ids", required=True, type=click.Path(exists=True, dir_okay=False),
              help="A file `distill pack` wrote.")
@click.option("--data-dir", default=None, help="The reply cache to fill [default: CACHE/distill/<target>].")
def restore_cmd(model, ids, data_dir) -> None:
    """Fill the reply cache from packed token ids: each missing reply's teacher logits are recomputed by
    batched prefill of the target (resumable, like `distill data`)."""
    target, _ = load(model)
    click.echo(json.dumps(restore_ids(Path(ids), data_root(model, data_dir), target,
                                      log=lambda s: click.echo(s, err=True))))


@distill_cmd.command("train")
@target_option
@click.option("--out", required=True, type=click.Path(file_okay=False), help="The draft folder to write.")
@click.option("--frozen", type=int, default=TrainConfig.frozen, show_default=True,
              help="E: the target's first layers, frozen.")
@click.option("--trained", type=int, default=TrainConfig.trained, show_default=True,
              help="k: layers after them, initialised from the target's next k, trained.")
@click.option("--kept", type=int, default=TrainConfig.kept, show_default=True,
              help="V: head rows, the ids the target writes most often in its training replies.")
@click.option("--init", type=click.Choice(["next", "last"]), default=TrainConfig.init, show_default=True,
              help="The trained layers start as the target's layers E..E+k-1 (next) or its last k (last).")
@click.option("--epochs", type=float, default=TrainConfig.epochs, show_default=True)
@click.option("--lr", type=float, default=TrainConfig.lr, show_default=True)
@click.option("--batch-tokens", type=int, default=TrainConfig.batch_tokens, show_default=True)
@click.option("--max-context", type=int, default=TrainConfig.max_context, show_default=True,
              help="Prompt tokens kept before a reply in training.")
@click.option("--train-tokens", type=int, default=None, help="Train on the first this-many reply tokens only.")
@click.option("--sources", default=",".join(TrainConfig.sources), show_default=True)
@click.option("--data-dir", default=None)
@click.option("--run-dir", default=None, help="Checkpoint folder [default: DATA/runs/<settings hash>].")
@click.option("--checkpoint-minutes", type=float, default=TrainConfig.checkpoint_minutes, show_default=True)
@click.option("--budget-minutes", type=float, default=None, help="Stop (with a checkpoint) after this long.")
@click.option("--seed", type=int, default=0, show_default=True)
def train_cmd(model, out, sources, budget_minutes, **kw) -> None:
    """Train (or resume: same settings, same run folder) a distilled draft; it is written to --out at every
    checkpoint with the held-out agreement so far."""
    cfg = TrainConfig(target=model, out=out, sources=tuple(s for s in sources.split(",") if s), **kw)
    r = refusing(ValueError, train, cfg, budget_minutes=budget_minutes, log=lambda s: click.echo(s, err=True))
    click.echo(json.dumps(r))


@distill_cmd.command("measure")
@target_option
@click.option("--draft", required=True, type=click.Path(file_okay=False), help="A distilled draft folder.")
@click.option("--data-dir", default=None)
@click.option("--cost/--no-cost", default=True, help="Also measure c, the 1-row forward cost ratio (one core each).")
def measure_cmd(model, draft, data_dir, cost) -> None:
    """Teacher-forced greedy agreement on the evaluation part's replies, over all and by category, and c."""
    root = data_root(model, data_dir)
    if not read_reply_files(root, ("eval",)):
        raise click.UsageError("no evaluation replies cached: run `mirror-mlx distill data` (or `distill restore "
                               "--ids` from packed ids) first")
    r = agreement_by_category(load_model(Path(draft))[0], root)
    if cost:
        r.update(cost_ratio(model, draft))
    click.echo(json.dumps(r))


@distill_cmd.command("loop")
@target_option
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Folder of drafts: OUT/round-NNN-SHAPE per round and shape, OUT/latest-SHAPE the newest.")
@click.option("--shape", "shapes", multiple=True, default=["6,1,16384"], show_default=True,
              help="E,k,V[,last] of a draft to train each round (repeat to compare shapes on the same data).")
@click.option("--epochs", type=float, default=TrainConfig.epochs, show_default=True)
@click.option("--lr", type=float, default=TrainConfig.lr, show_default=True)
@click.option("--generate-minutes", type=float, default=15.0, show_default=True,
              help="A generation turn; a round trains once the data has grown enough (--min-new-tokens, --growth).")
@click.option("--train-minutes", type=float, default=30.0, show_default=True, help="Training turn (checkpointed).")
@click.option("--min-new-tokens", type=int, default=20000, show_default=True,
              help="New reply tokens a round needs before it trains.")
@click.option("--growth", type=float, default=1.5, show_default=True,
              help="A round also needs this many times the reply tokens the last one trained on.")
@click.option("--rounds", type=int, default=DataConfig.rounds, show_default=True, help="Sampled data rounds.")
@click.option("--data-dir", default=None)
def loop_cmd(model, out, shapes, generate_minutes, train_minutes, min_new_tokens, growth, rounds, data_dir,
             **kw) -> None:
    """Generate and train in one process (one PID to pause): replies for a while, then each draft shape from
    scratch on all of them, and again. Killed and started again, it goes on where it stopped."""
    cfgs = []
    for shape in shapes:
        parts = shape.split(",")
        try:
            E, k, V = (int(x) for x in parts[:3])
        except ValueError:
            raise click.UsageError(f"--shape {shape!r}: give E,k,V (integers), optionally ,last")
        cfgs.append(TrainConfig(target=model, out=out, data_dir=data_dir, frozen=E, trained=k, kept=V,
                                init=parts[3] if len(parts) > 3 else "next", **kw))
    loop(DataConfig(target=model, data_dir=data_dir, rounds=rounds), cfgs, generate_minutes=generate_minutes,
         train_minutes=train_minutes, min_new_tokens=min_new_tokens, growth=growth,
         log=lambda s: click.echo(s, err=True))
