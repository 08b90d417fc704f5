"""Distil a cut-down draft from a chat target: the target's first layers, a few trained ones, a trimmed head.

1. Data (`generate_data`): the target's own replies (greedy, and sampled at T=0.7 and T=1.0) to
   Spec-Bench's training part rendered with its chat template, to the packaged code-edit prompts and to
   TinyStories openings of the corpus's training part. Prompts of similar length are batched with left
   padding (mlx-lm's BatchKVCache), finished rows leave the batch. Each reply is kept with the target's
   top-K logits at every reply position (the teacher's distribution, recorded while generating: no second
   pass) in one file per (prompt, temperature, seed) under cache_dir()/distill/<target>/replies/, so a
   killed run continues with what is missing. Spec-Bench's evaluation part is generated greedily into a
   separate `eval` source, for measurement only; no training reads it.
2. Draft (`DistilledDraft`): the target's first E layers (frozen), k decoder layers initialised from the
   target's layers E..E+k-1, the final norm, and the tied head cut to the V token ids the target writes
   most often in its training replies (the kept ids are stored with the draft). Its forward returns
   logits over the whole vocabulary (-inf off the kept ids), so every consumer reads real token ids; a
   draft that proposes only kept tokens stays lossless because the target verifies every token.
3. Training (`train`): KL from the target's distribution restricted to the kept ids (renormalised top-K)
   to the draft's, on reply positions; checkpoints every few minutes; a time budget.
4. Measurement (`agreement`, `cost_ratio`): teacher-forced greedy agreement on the evaluation part's
   replies, and a 1-row forward's cost against the target's.
"""

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_unflatten
from mlx_lm.models.base import create_attention_mask
from mirror_mlx.loading import mlx_lm_load as load
from tqdm import tqdm

from mirror_mlx.corpus import eos_ids
from mirror_mlx.engine.model_parts import flat
from mirror_mlx.prompts import spec_bench_part
from mirror_mlx.drafts.distilled.model import new_draft, save_draft

from .distill_cost import cost_ratio  # noqa: F401  (what the command line measures with)
from .distill_data import (  # noqa: F401  (the data half, and what the command line reads of it)
    DataConfig,
    Reply,
    TRAIN_SOURCES,
    data_root,
    generate_data,
    load_reply,
    read_replies,
    read_reply_files,
)

# ------------------------------------------------------------------------------------------- training


def kept_ids_by_frequency(replies: Sequence[Reply], size: int, always: Iterable[int] = ()) -> np.ndarray:
    """The `size` token ids the target writes most often in `replies` (ties: lower id first), plus `always`
    (EOS) whatever their count; sorted."""
    counts = np.zeros(1 + max([int(r.reply.max()) for r in replies if len(r.reply)] + [0]), np.int64)
    for r in replies:
        np.add.at(counts, r.reply, 1)
    always = sorted(set(int(a) for a in always))
    order = [int(i) for i in np.lexsort((np.arange(len(counts)), -counts)) if counts[i] > 0 and int(i) not in always]
    return np.array(sorted(always + order[: max(0, size - len(always))]), np.int32)


@dataclass
class Example:
    tokens: np.ndarray  # (T,) context then reply (the last reply token is never an input)
    first: int  # index of the position whose logits predict reply[0]
    top_ids: np.ndarray  # (R, K)
    top_logits: np.ndarray  # (R, K)


def examples(replies: Sequence[Reply], max_context: Optional[int] = None) -> list[Example]:
    out = []
    for r in replies:
        if len(r.reply) == 0:
            continue
        prompt = r.prompt if max_context is None else r.prompt[-max_context:]
        tokens = np.concatenate([prompt, r.reply[:-1]]).astype(np.int32)
        out.append(Example(tokens, len(prompt) - 1, r.top_ids, r.top_logits))
    return out


def padded_tokens(ex: Sequence[Example]) -> np.ndarray:
    """The examples' tokens, right-padded with 0 to (B, T)."""
    tokens = np.zeros((len(ex), max(len(e.tokens) for e in ex)), np.int32)
    for b, e in enumerate(ex):
        tokens[b, :len(e.tokens)] = e.tokens
    return tokens


def make_batch(ex: Sequence[Example], kept: np.ndarray, vocab: int):
    """Right-padded (B, T) tokens, and per position (B, T, K) kept-row indices and teacher weights (the
    target's top-K restricted to kept ids, renormalised) and (B, T) loss mask."""
    tokens = padded_tokens(ex)
    B, T = tokens.shape
    K = ex[0].top_ids.shape[1]
    row_of = np.full(vocab, -1, np.int64)
    row_of[kept] = np.arange(len(kept))
    rows = np.zeros((B, T, K), np.int32)
    weights = np.zeros((B, T, K), np.float32)
    mask = np.zeros((B, T), np.float32)
    for b, e in enumerate(ex):
        R = len(e.top_ids)
        pos = slice(e.first, e.first + R)
        r = row_of[e.top_ids]
        logit = np.where(r >= 0, e.top_logits.astype(np.float32), -np.inf)
        m = logit.max(-1, keepdims=True)
        ok = np.isfinite(m[:, 0])
        w = np.where(ok[:, None], np.exp(logit - np.where(np.isfinite(m), m, 0)), 0)
        w = w / np.maximum(w.sum(-1, keepdims=True), 1e-30)
        rows[b, pos] = np.maximum(r, 0)
        weights[b, pos] = w
        mask[b, pos] = ok
    return tokens, rows, weights, mask


def split_forward(draft, tokens: mx.array, frozen: int) -> mx.array:
    """Kept-id logits, with no gradient through the frozen first layers."""
    inner = draft.model
    h = inner.embed_tokens(tokens)
    mask = create_attention_mask(h, None)
    for i, layer in enumerate(inner.layers):
        if i == frozen:
            h = mx.stop_gradient(h)
        h = layer(h, mask, None)
    if frozen >= len(inner.layers):
        h = mx.stop_gradient(h)
    return draft.head(inner.norm(h))


def distill_loss(draft, tokens, rows, weights, mask, *, frozen: int):
    logq = nn.log_softmax(split_forward(draft, tokens, frozen), axis=-1)
    ce = -(weights * mx.take_along_axis(logq, rows, axis=-1)).sum(-1)
    return (ce * mask).sum() / mx.maximum(mask.sum(), 1)


@dataclass
class TrainConfig:
    target: str
    out: str  # the draft folder written at the end (and at each checkpoint's best)
    frozen: int = 6  # E
    trained: int = 1  # k
    kept: int = 16384  # V
    init: str = "next"  # the trained layers start as the target's layers E..E+k-1 ("next") or its last k ("last")
    epochs: float = 2.0
    lr: float = 1e-3
    batch_tokens: int = 2048  # padded tokens per step
    max_context: int = 384  # prompt tokens kept before each reply in training (measurement sees all)
    train_tokens: Optional[int] = None  # use only the first this-many reply tokens (greedy replies first)
    sources: tuple = TRAIN_SOURCES
    data_dir: Optional[str] = None
    seed: int = 0
    checkpoint_minutes: float = 5.0
    eval_replies: int = 96  # held-out replies measured at the end (spread over the categories; a quarter between)
    run_dir: Optional[str] = None  # default: DATA/runs/<hash of the settings>


def run_key(cfg: TrainConfig) -> dict:
    """Everything that decides a run's result (as JSON reads it back); a run folder only resumes the same."""
    return json.loads(json.dumps({k: v for k, v in asdict(cfg).items()
                                  if k not in ("out", "checkpoint_minutes", "run_dir", "eval_replies")}))


def _batches(exs: list[Example], batch_tokens: int, rng: np.random.Generator) -> list[list[int]]:
    """Examples grouped by length (little padding), groups shuffled."""
    groups: list[list[int]] = []
    cur: list = []
    for i in np.argsort([len(e.tokens) for e in exs], kind="stable"):
        if cur and len(exs[i].tokens) * (len(cur) + 1) > batch_tokens:  # (the longest so far: sorted by length)
            groups.append(cur)
            cur = []
        cur.append(int(i))
    if cur:
        groups.append(cur)
    return [groups[j] for j in rng.permutation(len(groups))]


def agreement(draft, replies: Sequence[Reply], batch_tokens: int = 8192) -> dict:
    """Teacher-forced greedy agreement: how often the draft's argmax (a real vocabulary id) is the target's
    argmax, over every reply position of `replies`, each with its whole prompt as context."""
    exs = examples(replies)
    hit = n = 0
    kept = np.array(draft.kept_ids)
    for group in _batches(exs, batch_tokens, np.random.default_rng(0)):
        ex = [exs[i] for i in group]
        guess = np.array(mx.argmax(draft.kept_logits(mx.array(padded_tokens(ex))), axis=-1))
        for b, e in enumerate(ex):
            g = kept[guess[b, e.first:e.first + len(e.top_ids)]]
            hit += int((g == e.top_ids[:, 0]).sum())
            n += len(e.top_ids)
    return {"agreement": hit / max(1, n), "positions": n}


def agreement_by_category(draft, root: Path) -> dict:
    """`agreement` on the evaluation part's replies cached under `root`, over all and per Spec-Bench category
    (an evaluation reply's index is its prompt's in `spec_bench_part("eval")`)."""
    files = read_reply_files(root, ("eval",))
    category = [p.category for p in spec_bench_part("eval")]
    groups: dict[str, list[Reply]] = {}
    for f in files:
        groups.setdefault(category[int(f.name.split("-")[1])], []).append(load_reply(f))
    out = agreement(draft, [r for g in groups.values() for r in g])
    out["by_category"] = {c: agreement(draft, g) for c, g in sorted(groups.items())}
    out["eval_replies"] = len(files)
    return out


def _save_state(path: Path, draft, opt, step: int, extra: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    arrays = {"model." + k: v for k, v in flat(draft.trainable_parameters())}
    arrays.update({"opt." + k: v for k, v in flat(opt.state)})
    mx.save_safetensors(str(path / "state.tmp.safetensors"), arrays)
    os.replace(path / "state.tmp.safetensors", path / "state.safetensors")
    tmp = path / "progress.tmp.json"
    tmp.write_text(json.dumps(dict(extra, step=step), indent=2))
    os.replace(tmp, path / "progress.json")


def _run_files(run: Path, root: Path, key: dict, cfg: TrainConfig) -> list[str]:
    """The reply files a run trains on: fixed in its manifest when it starts, so a resumed run sees the same."""
    run.mkdir(parents=True, exist_ok=True)
    manifest = run / "manifest.json"
    if manifest.is_file():
        saved = json.loads(manifest.read_text())
        if saved["config"] != key:
            raise ValueError(f"{run} holds a run with other settings: give another run folder or delete it")
        return saved["files"]
    found = read_reply_files(root, cfg.sources, cfg.train_tokens)
    if not found:
        raise ValueError(f"no training replies in {root / 'replies'}: generate data first (distill data)")
    files = [p.name for p in found]
    manifest.write_text(json.dumps({"config": key, "files": files}, indent=1))
    return files


def _trainable_draft(model, target_config: dict, cfg: TrainConfig, kept: np.ndarray):
    """A fresh draft of cfg's shape: the first E layers frozen, the k trained ones, the norm and the head trainable."""
    n_target = target_config["num_hidden_layers"]
    if cfg.init not in ("next", "last"):
        raise ValueError(f"init {cfg.init!r}: use next (the target's layers E..E+k-1) or last (its last k)")
    init = list(range(n_target - cfg.trained, n_target)) if cfg.init == "last" else None
    draft = new_draft(model, target_config, cfg.frozen, cfg.trained, kept, init_layers=init)
    draft.freeze()
    for layer in draft.model.layers[cfg.frozen:]:
        layer.unfreeze()
    draft.model.norm.unfreeze()
    draft.head.unfreeze()
    return draft


def _resume(ckpt: Path, draft, opt) -> tuple[int, list]:
    """(step, history) of the run's last checkpoint, its weights and optimizer state loaded; (0, []) for none."""
    if not (ckpt / "progress.json").is_file():
        return 0, []
    prog = json.loads((ckpt / "progress.json").read_text())
    w = cast(dict[str, mx.array], mx.load(str(ckpt / "state.safetensors")))
    draft.update(tree_unflatten([(k[6:], v) for k, v in w.items() if k.startswith("model.")]))
    opt.state = tree_unflatten([(k[4:], v) for k, v in w.items() if k.startswith("opt.")])
    return prog["step"], prog.get("history", [])


def _steps(draft, opt, loss_and_grad, exs, kept, vocab: int, cfg: TrainConfig, step: int, total: int,
           steps_per_epoch: int, bar, deadline: Optional[float], stop_after: Optional[int],
           checkpoint: Callable[[], dict]) -> tuple[int, bool]:
    """Optimizer steps from `step` until `total` (the batch order a function of (seed, epoch) alone), a
    checkpoint every cfg.checkpoint_minutes; (the step reached, whether the deadline or `stop_after` cut it)."""
    last_ckpt, losses = time.time(), []
    while step < total:
        epoch = step // steps_per_epoch
        order = _batches(exs, cfg.batch_tokens, np.random.default_rng([cfg.seed, epoch]))
        tokens, rows, weights, mask = make_batch([exs[i] for i in order[step % steps_per_epoch]], kept, vocab)
        loss, grads = loss_and_grad(draft, mx.array(tokens), mx.array(rows), mx.array(weights), mx.array(mask))
        opt.update(draft, grads)
        mx.eval(loss, draft.trainable_parameters(), opt.state)
        losses.append(float(loss))
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")
        if step < total and ((stop_after is not None and step >= stop_after)
                             or (deadline is not None and time.time() > deadline)):
            return step, True
        if time.time() - last_ckpt > cfg.checkpoint_minutes * 60 and step < total:
            checkpoint()
            last_ckpt = time.time()
    return step, False


def train(cfg: TrainConfig, budget_minutes: Optional[float] = None, progress: bool = True,
          log: Callable[[str], None] = print, model=None, tokenizer=None,
          stop_after_steps: Optional[int] = None) -> dict:
    """Train (or resume) a distilled draft; writes cfg.out (the draft folder) at the end and at each checkpoint.

    The run's data (the reply files it trains on) is fixed when it starts and listed in its run folder, so a
    resumed run (same settings) continues exactly where its last checkpoint stopped: batch order depends on
    (seed, epoch) only. `budget_minutes` ends this call with a checkpoint; the same call again resumes."""
    t_start = time.time()
    if model is None:
        model, tokenizer = load(cfg.target)
    target_config = json.loads((Path(cfg.target) / "config.json").read_text())
    root = data_root(cfg.target, cfg.data_dir)
    key = run_key(cfg)
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    run = Path(cfg.run_dir) if cfg.run_dir else root / "runs" / digest
    replies = [load_reply(root / "replies" / f) for f in _run_files(run, root, key, cfg)]
    kept = kept_ids_by_frequency(replies, cfg.kept, eos_ids(tokenizer))
    exs = examples(replies, cfg.max_context)
    n_tokens = sum(len(e.top_ids) for e in exs)
    eval_replies = read_replies(root, ("eval",))
    eval_replies = eval_replies[:: max(1, len(eval_replies) // max(1, cfg.eval_replies))][: cfg.eval_replies]
    draft = _trainable_draft(model, target_config, cfg, kept)
    steps_per_epoch = len(_batches(exs, cfg.batch_tokens, np.random.default_rng(cfg.seed)))
    total = max(1, int(round(cfg.epochs * steps_per_epoch)))
    warm = min(50, max(1, total // 20))
    sched = optim.join_schedules([optim.linear_schedule(cfg.lr / warm, cfg.lr, warm),
                                  optim.cosine_decay(cfg.lr, max(1, total - warm), cfg.lr * 0.05)], [warm])
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.0)
    opt.init(draft.trainable_parameters())
    ckpt = run / "checkpoint"
    step, history = _resume(ckpt, draft, opt)

    def result(stopped: bool, entry: dict) -> dict:
        return {"run": str(run), "out": cfg.out, "steps": step, "total": total, "stopped": stopped,
                "reply_tokens": n_tokens, "replies": len(exs), **entry}

    if step:
        if step >= total and history and history[-1].get("measured_on") == "all" and \
                (Path(cfg.out) / "config.json").is_file():
            log(f"{run} is complete (step {step}/{total})")  # measured and written already
            return result(False, history[-1])
        log(f"resuming {run} at step {step}/{total}")
    else:
        log(f"training {run}: {len(exs)} replies, {n_tokens} reply tokens, {total} steps")
    loss_and_grad = nn.value_and_grad(draft, lambda m, *b: distill_loss(m, *b, frozen=cfg.frozen))
    vocab = target_config["vocab_size"]

    def checkpoint(final: bool = False) -> dict:
        mx.eval(draft.parameters(), opt.state)
        entry: dict[str, object] = {"step": step, "epoch": step / steps_per_epoch,
                                    "minutes": (time.time() - t_start) / 60}
        if eval_replies:  # between checkpoints a quarter of them, spread over the categories; all at the end
            entry.update(agreement(draft, eval_replies if final else eval_replies[::4]))
            entry["measured_on"] = "all" if final else "quarter"
        history.append(entry)
        _save_state(ckpt, draft, opt, step, {"history": history, "total": total})
        save_draft(draft, Path(cfg.out), Path(cfg.target),
                   extra={"distill": dict(key, step=step, total=total, reply_tokens=n_tokens, history=history)})
        log(f"checkpoint step {step}/{total}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                           for k, v in entry.items()))
        return entry

    bar = tqdm(total=total, initial=step, desc="distil draft", unit="step", disable=not progress)
    deadline = None if budget_minutes is None else t_start + budget_minutes * 60
    step, stopped = _steps(draft, opt, loss_and_grad, exs, kept, vocab, cfg, step, total, steps_per_epoch, bar,
                           deadline, stop_after_steps, checkpoint)
    bar.close()
    return result(stopped, checkpoint(final=not stopped))


# ------------------------------------------------------------------------------------------- the loop


def shape_name(cfg: TrainConfig) -> str:
    return f"E{cfg.frozen}k{cfg.trained}V{cfg.kept}" + ("" if cfg.init == "next" else f"-{cfg.init}")


def loop(data: DataConfig, train_cfgs: Sequence[TrainConfig], generate_minutes: float = 60.0,
         train_minutes: float = 60.0, min_new_tokens: int = 20000, growth: float = 1.5,
         log: Callable[[str], None] = print, progress: bool = True) -> None:
    """Data and training in one process (one PID to pause and resume): generate in turns of `generate_minutes`
    until there are `min_new_tokens` more reply tokens than the last round trained on and `growth` times as
    many (rounds at geometrically growing data, so retraining from scratch costs a few times the last), then
    train each draft shape of `train_cfgs` from scratch on every reply cached so far (a checkpointed run per
    round and shape, its draft written to OUT/round-NNN-SHAPE and OUT/latest-SHAPE), and again, until the
    schedule is generated and its last round trained. The shapes are compared on the same data each round.
    Killed and started again, it goes on: the replies are on disk, a round's runs resume from their checkpoints."""
    model, tokenizer = load(data.target)
    root = data_root(data.target, data.data_dir)
    state_file = root / "loop.json"
    while True:
        state: dict = json.loads(state_file.read_text()) if state_file.is_file() else {"round": 0, "trained_tokens": 0}
        r = state["round"]
        runs = [(c, root / "runs" / f"loop-r{r:03d}-{shape_name(c)}") for c in train_cfgs]
        mid_round = any((d / "manifest.json").is_file() for _, d in runs)
        finished = False
        if not mid_round:
            g = generate_data(data, progress=progress, log=log, stop_after_s=generate_minutes * 60,
                              model=model, tokenizer=tokenizer)
            finished = not g["stopped"]
            have = sum(len(np.load(p)["reply"]) for p in read_reply_files(root, train_cfgs[0].sources))
            if have < max(state["trained_tokens"] + min_new_tokens, growth * state["trained_tokens"]) and not finished:
                continue
        results = []
        for c, run_dir in runs:
            out = Path(c.out)
            cfg = TrainConfig(**dict(asdict(c), out=str(out / f"round-{r:03d}-{shape_name(c)}"), run_dir=str(run_dir)))
            res = train(cfg, budget_minutes=train_minutes, progress=progress, log=log, model=model, tokenizer=tokenizer)
            if res["stopped"]:  # its run folder has a manifest now: the next turn resumes it before generating
                break
            latest = out / f"latest-{shape_name(c)}"
            latest.unlink(missing_ok=True)
            latest.symlink_to(Path(cfg.out).name)
            log(f"round {r} {shape_name(c)}: {res['reply_tokens']} reply tokens, agreement "
                f"{res.get('agreement', float('nan')):.4f}")
            results.append(dict({k: v for k, v in res.items() if k != "run"}, shape=shape_name(c)))
        if len(results) < len(runs):  # (a run stopped)
            continue
        tmp = state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"round": r + 1, "trained_tokens": results[0]["reply_tokens"],
                                   "history": state.get("history", []) + [results]}, indent=1))
        os.replace(tmp, state_file)
        if finished:
            return
