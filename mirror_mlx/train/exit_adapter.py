"""Training an exit adapter (mirror_mlx/engine/exit_adapter.py): the target's own greedy text as (early state, final
state) rows, a KL fit of the adapter, and `mirror-mlx train-exit`'s whole run. Nothing the runtime imports
loads this module, so a generation never pulls in an optimizer or a progress bar."""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from tqdm import tqdm

from .. import demo as demo_pair
from ..corpus import CORPUS, HELD_OUT_PARAGRAPHS, eos_ids, greedy_continuations, split
from ..engine.batching import padded_batches
from ..engine.exit_adapter import ExitAdapter, adapter_meta, save_adapter
from ..engine.model_parts import text_model
from ..engine.readback import scalar
from ..options import default_exit_layer
from ..engine.target import EarlyExitTarget, apply_head, check_exit_layer
from ..loading import load_model

DEFAULT_RANK = 256  # hidden width of the residual MLP: on stories260K it beats a full-rank linear map
DEFAULT_STEPS = 6000


# ---- data: the target's own greedy text, as (normalised early state, normalised final state) rows


@dataclass
class ExitData:
    """Rows of the target's greedy text: x_early = norm(h_ℓe), x_final = the state the head sees."""

    x_early: mx.array  # (n, D)
    x_final: mx.array  # (n, D)


def exit_states(model: nn.Module, exit_layer: int, seqs: list[list[int]], starts: list[int],
                batch_size: int = 8, progress: bool = False, label: str = "") -> ExitData:
    """Early and final normalised states at the rows of `seqs` from `starts[i]` on (right-padded batches)."""
    got: list = []

    def capture(x):  # in the adapter's place: keeps the early state, changes nothing
        got.append(x)
        return x

    target = EarlyExitTarget(model, exit_layer, adapter=capture)
    inner = text_model(model).model
    xe, xf = [], []
    try:
        for j, chunk, tokens in tqdm(padded_batches(seqs, batch_size), desc=f"states L{exit_layer}{label}",
                                     unit="batch", total=-(-len(seqs) // batch_size), disable=not progress):
            got.clear()
            target.forward(tokens, cache=None)  # only the captured early state is evaluated: blocks 1..ℓ_e
            early = got[0]
            final = inner(tokens)  # mlx-lm inner models return the final-normalised state
            rows = [(b, t) for b, s in enumerate(chunk) for t in range(starts[j + b], len(s) - 1)]
            bi = mx.array([b for b, _ in rows])
            ti = mx.array([t for _, t in rows])
            xe.append(early[bi, ti])
            xf.append(final[bi, ti])
            mx.eval(xe[-1], xf[-1])
    finally:
        target.remove()
    return ExitData(mx.concatenate(xe).astype(mx.float32), mx.concatenate(xf).astype(mx.float32))


def greedy_rows(model: nn.Module, tokenizer, texts: list[str], max_tokens: int,
                max_prompt_tokens: int = 32, progress: bool = False,
                label: str = "") -> tuple[list[list[int]], list[int]]:
    """(sequences, starts): each opening plus the target's greedy continuation; rows from the last prompt token."""
    prompts = [tokenizer.encode(s)[:max_prompt_tokens] for s in texts]
    gens = greedy_continuations(model, prompts, max_tokens, eos_ids(tokenizer), progress=progress,
                                desc=f"greedy text{label}")
    keep = [(p, g) for p, g in zip(prompts, gens) if g]
    return [p + g for p, g in keep], [len(p) - 1 for p, _ in keep]


def kl(model: nn.Module, adapter: Optional[nn.Module], data: ExitData, batch: int = 4096) -> float:
    """Mean KL(final ‖ early) over the rows (nats)."""
    total = 0.0
    n = data.x_early.shape[0]
    for i in range(0, n, batch):
        total += scalar(_kl_rows(model, adapter, data.x_early[i : i + batch], data.x_final[i : i + batch]).sum())
    return total / max(n, 1)


def _kl_rows(model, adapter, xe: mx.array, xf: mx.array) -> mx.array:
    lp = nn.log_softmax(apply_head(model, xf[None]).astype(mx.float32)[0], axis=-1)
    x = adapter(xe) if adapter is not None else xe
    lq = nn.log_softmax(apply_head(model, x[None]).astype(mx.float32)[0], axis=-1)
    return (mx.exp(lp) * (lp - lq)).sum(axis=-1)


# ---- training


@dataclass
class TrainReport:
    exit_layer: int
    rank: int
    mlp: bool
    steps: int
    seed: int
    train_rows: int
    held_out_rows: int
    kl_before: float  # held-out, bare head
    kl_after: float  # held-out, with the adapter
    seconds: float


def exit_data(model: nn.Module, tokenizer, exit_layer: int, texts: list[str], max_tokens: int = 64,
              progress: bool = False, label: str = "") -> ExitData:
    """Training rows: the target's greedy continuation of each opening, states at `exit_layer` and at the end.
    `label` tells the progress bars of two calls apart (" (train)", " (held-out)")."""
    seqs, starts = greedy_rows(model, tokenizer, texts, max_tokens, progress=progress, label=label)
    return exit_states(model, exit_layer, seqs, starts, progress=progress, label=label)


def fit_adapter(model: nn.Module, train: ExitData, rank: int, steps: int, seed: int = 0, mlp: bool = True,
                lr: float = 3e-3, batch_size: int = 256, progress: bool = True,
                desc: str = "train-exit") -> ExitAdapter:
    """Adam on mean KL(final ‖ head(adapter(x_early))) over shuffled minibatches; deterministic per seed."""
    mx.random.seed(seed)
    adapter = ExitAdapter(text_model(model).model.norm.weight.shape[-1], rank, mlp)
    mx.eval(adapter.parameters())
    opt = optim.Adam(learning_rate=optim.cosine_decay(lr, max(steps, 1), lr * 0.01))

    def loss_fn(a, xe, xf):
        return _kl_rows(model, a, xe, xf).mean()

    step_fn = nn.value_and_grad(adapter, loss_fn)
    rng = np.random.default_rng(seed)
    n = train.x_early.shape[0]
    batch_size = min(batch_size, n)
    order, pos = rng.permutation(n), 0
    bar = tqdm(range(steps), desc=desc, unit="step", disable=not progress)
    for step in bar:
        if pos + batch_size > n:
            order, pos = rng.permutation(n), 0
        idx = mx.array(order[pos : pos + batch_size])
        pos += batch_size
        loss, grads = step_fn(adapter, train.x_early[idx], train.x_final[idx])
        opt.update(adapter, grads)
        mx.eval(adapter.parameters(), opt.state, loss)
        if step % 50 == 0:
            bar.set_postfix(kl=f"{loss.item():.3f}")
    return adapter


def train_exit_adapter(
    model: nn.Module,
    tokenizer,
    exit_layer: int,
    corpus_text: str,
    rank: int = DEFAULT_RANK,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    mlp: bool = True,
    lr: float = 3e-3,
    batch_size: int = 256,
    max_openings: Optional[int] = None,
    held_out_openings: int = 64,
    max_tokens: int = 64,
    progress: bool = True,
    tokens: Optional[int] = None,
) -> tuple[ExitAdapter, TrainReport]:
    """Distil an adapter at `exit_layer` on the target's greedy text over the training paragraphs' openings
    (deterministic per seed); KL is reported on the held-out openings (corpus.split, the benchmark's side).
    `tokens` bounds the text phase: ⌈tokens / max_tokens⌉ training openings, a tenth of that held out."""
    check_exit_layer(exit_layer, len(text_model(model).layers))
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    if steps < 0:
        raise ValueError(f"steps must be non-negative, got {steps}")
    t0 = time.perf_counter()
    parts = split(corpus_text)
    train_txt, held_txt = parts.train_openings, parts.held_out
    if tokens is not None:
        if tokens < 1:
            raise ValueError(f"tokens must be at least 1, got {tokens}")
        max_openings = min(max_openings or len(train_txt), -(-tokens // max_tokens))
        held_out_openings = min(held_out_openings, max(1, max_openings // 10))
    train_txt = train_txt[:max_openings] if max_openings else train_txt
    held_txt = held_txt[:held_out_openings]
    if not train_txt or not held_txt:
        raise ValueError("the corpus has too few openings (sentences in paragraphs separated by blank lines)")
    train = exit_data(model, tokenizer, exit_layer, train_txt, max_tokens, progress, " (train)")
    held = exit_data(model, tokenizer, exit_layer, held_txt, max_tokens, progress, " (held-out)")
    adapter = fit_adapter(model, train, rank, steps, seed, mlp, lr, batch_size, progress, f"train-exit L{exit_layer}")
    report = TrainReport(exit_layer, rank, mlp, steps, seed, train.x_early.shape[0], held.x_early.shape[0],
                         kl(model, None, held), kl(model, adapter, held), time.perf_counter() - t0)
    return adapter, report


# ---- command line


def train_and_save(out: Path, model_path: Optional[str] = None, exit_layer: Optional[int] = None,
                   corpus: Optional[Path] = None, progress: bool = True, **kwargs: Any) -> TrainReport:
    """`mirror-mlx train-exit`: check the inputs before any work, train, write the adapter file."""
    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"--out must end in .safetensors, got {out}")
    if not out.parent.is_dir():
        raise ValueError(f"the folder {out.parent} does not exist")
    if corpus is None and model_path is not None:
        raise ValueError("give --corpus: a general-text file (paragraphs split by blank lines) in the model's domain; "
                         "the packaged TinyStories sample only suits the demo target")
    corpus = Path(corpus or CORPUS)
    if not corpus.is_file():
        raise ValueError(f"corpus file {corpus} does not exist")
    model, tokenizer = load_model(model_path or demo_pair.TARGET)
    n_layers = len(text_model(model).layers)
    exit_layer = default_exit_layer(n_layers) if exit_layer is None else exit_layer
    check_exit_layer(exit_layer, n_layers)
    meta = adapter_meta(model, exit_layer, model_name=str(model_path or demo_pair.TARGET.name), corpus=corpus.name,
                        held_out_paragraphs=HELD_OUT_PARAGRAPHS)
    adapter, report = train_exit_adapter(model, tokenizer, exit_layer, corpus.read_text(encoding="utf-8"),
                                         progress=progress, **kwargs)
    meta.update(steps=report.steps, seed=report.seed, kl_bare=f"{report.kl_before:.4f}",
                kl_adapted=f"{report.kl_after:.4f}")
    save_adapter(out, adapter, meta)
    return report
