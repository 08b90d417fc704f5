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
import math
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

TOP_K = 32  # teacher logits kept per reply position
MAX_PROMPT = 1536  # longer rendered prompts are skipped (a few Spec-Bench rag/summarization ones)
PREFILL_TOKENS = 6144  # rows x padded prompt length per batch (bounds the prefill's attention memory)
SOURCES = ("eval", "spec_bench", "code_edit", "tinystories")
TRAIN_SOURCES = SOURCES[1:]


def distill_dir() -> Path:
    from mirror_mlx.tune.profile import cache_dir

    return cache_dir() / "distill"


def target_tag(target_dir: Path) -> str:
    """A short name for a target folder's data: its config and weight file sizes, hashed."""
    target_dir = Path(target_dir)
    h = hashlib.sha1((target_dir / "config.json").read_bytes())
    for p in sorted(target_dir.glob("*.safetensors")):
        h.update(f"{p.name}:{p.stat().st_size}".encode())
    return f"{target_dir.name}-{h.hexdigest()[:10]}"


# --------------------------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Job:
    source: str  # one of SOURCES
    index: int  # the prompt's index in its source
    text: str  # the user message
    temperature: float
    seed: int

    @property
    def row_seed(self) -> int:
        """The sampling seed of this reply alone (from its key)."""
        return int(hashlib.sha1(self.key.encode()).hexdigest()[:7], 16)

    @property
    def key(self) -> str:
        h = hashlib.sha1(json.dumps([self.text, self.temperature, self.seed]).encode()).hexdigest()[:16]
        return f"{self.source}-{self.index:05d}-t{self.temperature:g}-s{self.seed}-{h}"


def source_prompts(source: str, tinystories_n: int = 1000) -> list[str]:
    """The user messages of one source, in a fixed order."""
    from mirror_mlx.prompts import DATA, jsonl, spec_bench_part

    if source == "eval":
        return [p.text for p in spec_bench_part("eval")]
    if source == "spec_bench":
        return [p.text for p in spec_bench_part("train")]
    if source == "code_edit":
        return [p.text for p in jsonl(DATA / "code_edit.jsonl")]
    if source == "tinystories":
        from mirror_mlx.corpus import distinct_openings, load_split

        openings = distinct_openings(load_split().train)[:tinystories_n]
        return [f"Write a short story for children that begins with: \"{o}\"" for o in openings]
    raise ValueError(f"unknown data source {source!r}: use one of {', '.join(SOURCES)}")


ROUND0 = ((0.0, 0), (0.7, 1), (1.0, 1))  # (temperature, seed) of each prompt's first round


def round_variants(r: int) -> tuple:
    """The (temperature, seed) replies round `r` adds per training prompt: greedy and one sample at each
    temperature first, then one more sample at each temperature per round."""
    return ROUND0 if r == 0 else ((0.7, r + 1), (1.0, r + 1))


def schedule(rounds: int = 4, tinystories_n: int = 1000, sources: Sequence[str] = SOURCES,
             prompts: Optional[dict] = None) -> list[list[Job]]:
    """Phases in the order they are worth generating: the evaluation replies (greedy), then the training
    sources round by round (round 0: greedy, T=0.7 and T=1.0; later rounds: new samples at both).
    `prompts` ({source: [user message, ...]}) replaces the packaged prompts (tests, custom sets)."""
    prompts = prompts if prompts is not None else {s: source_prompts(s, tinystories_n) for s in sources}
    sources = list(prompts)
    phases = [[Job("eval", i, t, 0.0, 0) for i, t in enumerate(prompts.get("eval", []))]]
    train = [s for s in sources if s != "eval"]
    for r in range(rounds + 1):
        for s in train:
            phases.append([Job(s, i, t, temp, seed) for i, t in enumerate(prompts[s]) for temp, seed in round_variants(r)])
    return [p for p in phases if p]


def render(tokenizer, text: str) -> list[int]:
    """One user message through the chat template, with the generation prompt (plain text without one)."""
    if getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    return list(tokenizer.encode(text))


# ------------------------------------------------------------------------------------------ generation


@dataclass
class Reply:
    prompt: np.ndarray  # (P,) int32 rendered prompt
    reply: np.ndarray  # (R,) int32 the target's reply, EOS included when it stopped
    top_ids: np.ndarray  # (R, K) int32: the target's top-K ids at each reply position (predicting reply[i])
    top_logits: np.ndarray  # (R, K) float16: their logits


def save_reply(path: Path, r: Reply) -> None:
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, prompt=r.prompt, reply=r.reply, top_ids=r.top_ids, top_logits=r.top_logits)
    os.replace(tmp, path)  # whole or not at all: a killed run never leaves half a file


def load_reply(path: Path) -> Reply:
    z = np.load(path)
    return Reply(z["prompt"], z["reply"], z["top_ids"], z["top_logits"])


def batched_replies(model: nn.Module, prompts: list[list[int]], variants: list[list[tuple]], max_tokens: int,
                    eos: Iterable[int], top_k: int = TOP_K) -> list[list[Reply]]:
    """The model's replies to `prompts`, each prompt prefilled once (left-padded batch) and then decoded once
    per (temperature, seed) of its `variants` (its cache rows repeated); a row leaves at its first EOS.
    A sampled row draws with its own key (its seed and the step), so a reply does not depend on its batch.
    Returns, per prompt, one Reply per variant."""
    from mlx_lm.models.cache import BatchKVCache

    eos = set(int(e) for e in eos)
    longest = max(len(p) for p in prompts)
    pads = [longest - len(p) for p in prompts]
    x = mx.array([[0] * pad + list(p) for pad, p in zip(pads, prompts)], dtype=mx.int32)
    cache = [BatchKVCache(pads) for _ in range(len(model.layers))]
    logits = model(x, cache=cache)[:, -1, :].astype(mx.float32)
    rows = [(i, v) for i, vs in enumerate(variants) for v in range(len(vs))]  # (prompt, variant) per row
    idx = mx.array([i for i, _ in rows])
    for c in cache:
        c.filter(idx)
    logits = logits[idx]
    temps = np.array([variants[i][v][0] for i, v in rows], np.float32)
    seeds = [variants[i][v][1] for i, v in rows]
    live = list(range(len(rows)))
    out_tok: list[list[int]] = [[] for _ in rows]
    out_ids: list[list[np.ndarray]] = [[] for _ in rows]
    out_val: list[list[np.ndarray]] = [[] for _ in rows]
    for step in range(max_tokens):
        ids = mx.argpartition(-logits, top_k - 1, axis=-1)[:, :top_k]
        vals = mx.take_along_axis(logits, ids, axis=-1)
        t = temps[live]
        if (t == 0).all():
            y = mx.argmax(logits, axis=-1)
        else:
            noise = mx.stack([mx.random.gumbel(logits.shape[-1:], key=mx.random.key(seeds[row] * 100003 + step))
                              for row in live])
            drawn = mx.argmax(logits / mx.array(np.maximum(t, 1e-6))[:, None] + noise, axis=-1)
            y = mx.where(mx.array(t == 0), mx.argmax(logits, axis=-1), drawn)
        mx.eval(y, ids, vals)
        y_np, ids_np, vals_np = np.array(y), np.array(ids), np.array(vals).astype(np.float16)
        keep = []
        for b, row in enumerate(live):
            out_tok[row].append(int(y_np[b]))
            out_ids[row].append(ids_np[b])
            out_val[row].append(vals_np[b])
            if int(y_np[b]) not in eos:
                keep.append(b)
        if not keep or step == max_tokens - 1:
            break
        y = y.astype(mx.int32)
        if len(keep) < len(live):
            sel = mx.array(keep)
            for c in cache:
                c.filter(sel)
            y = y[sel]
            live = [live[b] for b in keep]
        logits = model(y[:, None], cache=cache)[:, -1, :].astype(mx.float32)
    out: list[list[Reply]] = [[] for _ in prompts]
    for r, (i, _) in enumerate(rows):
        order = [np.argsort(-v.astype(np.float32), kind="stable") for v in out_val[r]]
        out[i].append(Reply(np.array(prompts[i], np.int32), np.array(out_tok[r], np.int32),
                            np.stack([a[o] for a, o in zip(out_ids[r], order)]).astype(np.int32),
                            np.stack([a[o] for a, o in zip(out_val[r], order)]).astype(np.float16)))
    return out


@dataclass
class DataConfig:
    target: str
    data_dir: Optional[str] = None  # default: distill_dir()/<target tag>
    max_tokens: int = 256
    batch_size: int = 18  # rows decoded together (prompts x their variants)
    rounds: int = 4  # sampled rounds after the greedy one
    tinystories: int = 1000
    sources: tuple = SOURCES
    prompts: Optional[dict] = None  # {source: [user message, ...]} instead of the packaged sources


def data_root(target: str, data_dir: Optional[str] = None) -> Path:
    return Path(data_dir) if data_dir else distill_dir() / target_tag(Path(target))


def generate_data(cfg: DataConfig, progress: bool = True, log: Callable[[str], None] = print,
                  stop_after_s: Optional[float] = None, model=None, tokenizer=None) -> dict:
    """Generate every missing reply of the schedule into DATA/replies (one .npz each). Returns counts."""
    from tqdm import tqdm

    from mirror_mlx.corpus import eos_ids

    if model is None:
        from mlx_lm.utils import load

        model, tokenizer = load(cfg.target)
    root = data_root(cfg.target, cfg.data_dir)
    replies = root / "replies"
    replies.mkdir(parents=True, exist_ok=True)
    (root / "data.json").write_text(json.dumps({k: v for k, v in asdict(cfg).items() if k != "prompts"}, indent=2, default=list))
    eos = eos_ids(tokenizer)
    phases = [[j for j in phase if not (replies / f"{j.key}.npz").exists()]
              for phase in schedule(cfg.rounds, cfg.tinystories, cfg.sources, cfg.prompts)]
    phases = [p for p in phases if p]
    total = sum(len(p) for p in phases)
    log(f"distill data: {root} ({total} replies to generate)")
    t0, made, tokens = time.time(), 0, 0
    bar = tqdm(total=total, desc="target replies", unit="reply", disable=not progress, smoothing=0.05)
    for phase in phases:
        by_text: dict[str, list[Job]] = {}
        for j in phase:
            by_text.setdefault(j.text, []).append(j)
        groups = [(render(tokenizer, text), js) for text, js in by_text.items()]
        groups = sorted((g for g in groups if len(g[0]) <= MAX_PROMPT), key=lambda g: len(g[0]))
        i = 0
        while i < len(groups):
            per = len(groups[i][1])
            P = max(1, cfg.batch_size // per)
            L = len(groups[min(len(groups) - 1, i + P - 1)][0])
            P = max(1, min(P, PREFILL_TOKENS // max(1, L)))
            batch = groups[i:i + P]
            i += P
            out = batched_replies(model, [g[0] for g in batch], [[(j.temperature, j.row_seed) for j in g[1]]
                                                                 for g in batch], cfg.max_tokens, eos)
            for (_, js), rs in zip(batch, out):
                for j, r in zip(js, rs):
                    save_reply(replies / f"{j.key}.npz", r)
                    tokens += len(r.reply)
                    made += 1
                    bar.update(1)
            bar.set_postfix(tok_s=f"{tokens / max(1e-9, time.time() - t0):.0f}", tokens=tokens)
            if stop_after_s is not None and time.time() - t0 > stop_after_s:
                bar.close()
                return {"made": made, "tokens": tokens, "seconds": time.time() - t0, "stopped": True}
    bar.close()
    return {"made": made, "tokens": tokens, "seconds": time.time() - t0, "stopped": False}


def read_replies(root: Path, sources: Sequence[str], limit_tokens: Optional[int] = None) -> list[Reply]:
    """Cached replies of `sources` (greedy first, read_reply_files' order)."""
    return [load_reply(p) for p in read_reply_files(root, sources, limit_tokens)]


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


def make_batch(ex: Sequence[Example], kept: np.ndarray, vocab: int):
    """Right-padded (B, T) tokens, and per position (B, T, K) kept-row indices and teacher weights (the
    target's top-K restricted to kept ids, renormalised), (B, T) loss mask and teacher argmax (vocab id)."""
    B, T = len(ex), max(len(e.tokens) for e in ex)
    K = ex[0].top_ids.shape[1]
    row_of = np.full(vocab, -1, np.int64)
    row_of[kept] = np.arange(len(kept))
    tokens = np.zeros((B, T), np.int32)
    rows = np.zeros((B, T, K), np.int32)
    weights = np.zeros((B, T, K), np.float32)
    mask = np.zeros((B, T), np.float32)
    top1 = np.full((B, T), -1, np.int32)
    for b, e in enumerate(ex):
        tokens[b, :len(e.tokens)] = e.tokens
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
        top1[b, pos] = e.top_ids[:, 0]
    return tokens, rows, weights, mask, top1


def split_forward(draft, tokens: mx.array, frozen: int) -> mx.array:
    """Kept-id logits, with no gradient through the frozen first layers."""
    from mlx_lm.models.base import create_attention_mask

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


def distill_loss(draft, tokens, rows, weights, mask, frozen: int):
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
    order = np.argsort([len(e.tokens) for e in exs], kind="stable")
    groups, cur, longest = [], [], 0
    for i in order:
        L = len(exs[i].tokens)
        if cur and max(longest, L) * (len(cur) + 1) > batch_tokens:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(int(i))
        longest = max(longest, L)
    if cur:
        groups.append(cur)
    return [groups[j] for j in rng.permutation(len(groups))]


def agreement(draft, replies: Sequence[Reply], batch_tokens: int = 8192, kept_logits: bool = True) -> dict:
    """Teacher-forced greedy agreement: how often the draft's argmax (a real vocabulary id) is the target's
    argmax, over every reply position of `replies`, each with its whole prompt as context."""
    exs = examples(replies)
    hit = n = 0
    kept = np.array(draft.kept_ids)
    for group in _batches(exs, batch_tokens, np.random.default_rng(0)):
        ex = [exs[i] for i in group]
        B, T = len(ex), max(len(e.tokens) for e in ex)
        tokens = np.zeros((B, T), np.int32)
        for b, e in enumerate(ex):
            tokens[b, :len(e.tokens)] = e.tokens
        guess = np.array(mx.argmax(draft.kept_logits(mx.array(tokens)), axis=-1))
        for b, e in enumerate(ex):
            g = kept[guess[b, e.first:e.first + len(e.top_ids)]]
            hit += int((g == e.top_ids[:, 0]).sum())
            n += len(e.top_ids)
    return {"agreement": hit / max(1, n), "positions": n}


def _save_state(path: Path, draft, opt, step: int, extra: dict) -> None:
    from mlx.utils import tree_flatten

    path.mkdir(parents=True, exist_ok=True)
    arrays = {"model." + k: v for k, v in tree_flatten(draft.trainable_parameters())}
    arrays.update({"opt." + k: v for k, v in tree_flatten(opt.state)})
    mx.save_safetensors(str(path / "state.tmp.safetensors"), arrays)
    os.replace(path / "state.tmp.safetensors", path / "state.safetensors")
    tmp = path / "progress.tmp.json"
    tmp.write_text(json.dumps(dict(extra, step=step), indent=2))
    os.replace(tmp, path / "progress.json")


def train(cfg: TrainConfig, budget_minutes: Optional[float] = None, progress: bool = True,
          log: Callable[[str], None] = print, model=None, tokenizer=None, stop_after_steps: Optional[int] = None) -> dict:
    """Train (or resume) a distilled draft; writes cfg.out (the draft folder) at the end and at each checkpoint.

    The run's data (the reply files it trains on) is fixed when it starts and listed in its run folder, so a
    resumed run (same settings) continues exactly where its last checkpoint stopped: batch order depends on
    (seed, epoch) only. `budget_minutes` ends this call with a checkpoint; the same call again resumes."""
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten, tree_unflatten
    from tqdm import tqdm

    from mirror_mlx.corpus import eos_ids
    from mirror_mlx.drafts.distilled import new_draft, save_draft

    t_start = time.time()
    if model is None:
        from mlx_lm.utils import load

        model, tokenizer = load(cfg.target)
    target_config = json.loads((Path(cfg.target) / "config.json").read_text())
    root = data_root(cfg.target, cfg.data_dir)
    key = run_key(cfg)
    run = Path(cfg.run_dir) if cfg.run_dir else root / "runs" / hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    run.mkdir(parents=True, exist_ok=True)
    manifest = run / "manifest.json"
    if manifest.is_file():
        saved = json.loads(manifest.read_text())
        if saved["config"] != key:
            raise ValueError(f"{run} holds a run with other settings: give another run folder or delete it")
        files = saved["files"]
    else:
        replies_dir = root / "replies"
        found = read_reply_files(root, cfg.sources, cfg.train_tokens)
        if not found:
            raise ValueError(f"no training replies in {replies_dir}: generate data first (distill data)")
        files = [p.name for p in found]
        manifest.write_text(json.dumps({"config": key, "files": files}, indent=1))
    replies = [load_reply(root / "replies" / f) for f in files]
    kept = kept_ids_by_frequency(replies, cfg.kept, eos_ids(tokenizer))
    exs = examples(replies, cfg.max_context)
    n_tokens = sum(len(e.top_ids) for e in exs)
    eval_replies = read_replies(root, ("eval",))
    eval_replies = eval_replies[:: max(1, len(eval_replies) // max(1, cfg.eval_replies))][: cfg.eval_replies]

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
    rng0 = np.random.default_rng(cfg.seed)
    steps_per_epoch = len(_batches(exs, cfg.batch_tokens, rng0))
    total = max(1, int(round(cfg.epochs * steps_per_epoch)))
    warm = min(50, max(1, total // 20))
    sched = optim.join_schedules([optim.linear_schedule(cfg.lr / warm, cfg.lr, warm),
                                  optim.cosine_decay(cfg.lr, max(1, total - warm), cfg.lr * 0.05)], [warm])
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.0)
    opt.init(draft.trainable_parameters())
    step, history = 0, []
    ckpt = run / "checkpoint"
    if (ckpt / "progress.json").is_file():
        prog = json.loads((ckpt / "progress.json").read_text())
        w = mx.load(str(ckpt / "state.safetensors"))
        draft.update(tree_unflatten([(k[6:], v) for k, v in w.items() if k.startswith("model.")]))
        opt.state = tree_unflatten([(k[4:], v) for k, v in w.items() if k.startswith("opt.")])
        step, history = prog["step"], prog.get("history", [])
        if step >= total and history and history[-1].get("measured_on") == "all" and (Path(cfg.out) / "config.json").is_file():
            log(f"{run} is complete (step {step}/{total})")  # measured and written already
            return {"run": str(run), "out": cfg.out, "steps": step, "total": total, "stopped": False,
                    "reply_tokens": n_tokens, "replies": len(exs), **history[-1]}
        log(f"resuming {run} at step {step}/{total}")
    else:
        log(f"training {run}: {len(exs)} replies, {n_tokens} reply tokens, {total} steps")
    loss_and_grad = nn.value_and_grad(draft, lambda m, *b: distill_loss(m, *b, frozen=cfg.frozen))
    vocab = target_config["vocab_size"]

    def checkpoint(final: bool = False) -> dict:
        mx.eval(draft.parameters(), opt.state)
        entry = {"step": step, "epoch": step / steps_per_epoch, "minutes": (time.time() - t_start) / 60}
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

    stopped = False
    bar = tqdm(total=total, initial=step, desc="distil draft", unit="step", disable=not progress)
    last_ckpt = time.time()
    losses = []
    while step < total:
        epoch = step // steps_per_epoch
        order = _batches(exs, cfg.batch_tokens, np.random.default_rng([cfg.seed, epoch]))
        group = order[step % steps_per_epoch]
        tokens, rows, weights, mask, _ = make_batch([exs[i] for i in group], kept, vocab)
        loss, grads = loss_and_grad(draft, mx.array(tokens), mx.array(rows), mx.array(weights), mx.array(mask))
        opt.update(draft, grads)
        mx.eval(loss, draft.trainable_parameters(), opt.state)
        losses.append(float(loss))
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")
        out_of_time = budget_minutes is not None and time.time() - t_start > budget_minutes * 60
        if stop_after_steps is not None and step >= stop_after_steps and step < total:
            stopped = True
            break
        if out_of_time and step < total:
            stopped = True
            break
        if time.time() - last_ckpt > cfg.checkpoint_minutes * 60 and step < total:
            checkpoint()
            last_ckpt = time.time()
    bar.close()
    entry = checkpoint(final=not stopped)
    return {"run": str(run), "out": cfg.out, "steps": step, "total": total, "stopped": stopped,
            "reply_tokens": n_tokens, "replies": len(exs), **entry}


def read_reply_files(root: Path, sources: Sequence[str], limit_tokens: Optional[int] = None) -> list[Path]:
    """The cached reply files of `sources`: greedy ones first, then each sampled round, each in source order;
    up to `limit_tokens` reply tokens."""
    files = [p for p in (Path(root) / "replies").glob("*.npz")
             if not p.name.endswith(".tmp.npz") and p.name.split("-")[0] in sources]
    files.sort(key=lambda p: (int(p.name.split("-s")[-1].split("-")[0]), p.name))
    if limit_tokens is None:
        return files
    out, n = [], 0
    for p in files:
        with np.load(p) as z:
            n += len(z["reply"])
        out.append(p)
        if n >= limit_tokens:
            break
    return out


# ------------------------------------------------------------------------------------------- cost


_COST_SCRIPT = r"""
import json, sys, time
import mirror_mlx
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model
from pathlib import Path

def timer(model, context):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, context), mx.int32), cache=cache))
    y = mx.zeros((1, 1), mx.int32)
    def run(reps):
        t = time.perf_counter()
        for _ in range(reps):
            mx.eval(model(y, cache=cache))
            for c in cache:
                c.trim(1)
        return (time.perf_counter() - t) / reps * 1000
    run(3)
    return run

a = json.loads(sys.argv[1])
mx.set_default_device(mx.cpu)
target = timer(load_model(Path(a["target"]))[0], a["context"])
draft = timer(load_model(Path(a["draft"]))[0], a["context"])
t, d = [], []
for _ in range(a["rounds"]):  # interleaved; the fastest round of each is the least disturbed
    t.append(target(a["reps"]))
    d.append(draft(a["reps"] * 3))
print(json.dumps({"target_ms": min(t), "draft_ms": min(d)}))
"""


def cost_ratio(target: str, draft: str, context: int = 256, reps: int = 10, core: int = 0, rounds: int = 7) -> dict:
    """c: the draft's 1-row forward (KV cache of `context` tokens, float32) over the target's, each run
    on one core (OPENBLAS_NUM_THREADS=1, pinned with taskset where there is one), in a fresh process."""
    import shutil
    import subprocess
    import sys

    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-c", _COST_SCRIPT, json.dumps({"target": str(target), "draft": str(draft),
                                                           "context": context, "reps": reps,
                                                           "rounds": rounds})]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", str(core)] + cmd
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"cost measurement failed: {done.stderr.strip().splitlines()[-1:]}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    r["c"] = r["draft_ms"] / r["target_ms"]
    return r


def untrained_draft(target: str, out: str, frozen: int, trained: int, kept: int, model=None) -> Path:
    """A draft folder of this shape with the first `kept` ids (for cost measurements: cost does not
    depend on which ids are kept or on training)."""
    from mirror_mlx.drafts.distilled import new_draft, save_draft

    if model is None:
        from mlx_lm.utils import load_model

        model = load_model(Path(target))[0]
    config = json.loads((Path(target) / "config.json").read_text())
    return save_draft(new_draft(model, config, frozen, trained, np.arange(kept)), Path(out), Path(target))


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
    from mlx_lm.utils import load

    model, tokenizer = load(data.target)
    root = data_root(data.target, data.data_dir)
    state_file = root / "loop.json"
    while True:
        state = json.loads(state_file.read_text()) if state_file.is_file() else {"round": 0, "trained_tokens": 0}
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
        results, stopped = [], False
        for c, run_dir in runs:
            out = Path(c.out)
            cfg = TrainConfig(**dict(asdict(c), out=str(out / f"round-{r:03d}-{shape_name(c)}"), run_dir=str(run_dir)))
            res = train(cfg, budget_minutes=train_minutes, progress=progress, log=log, model=model, tokenizer=tokenizer)
            if res["stopped"]:
                stopped = True  # its run folder has a manifest now: the next turn resumes it before generating
                break
            latest = out / f"latest-{shape_name(c)}"
            if latest.is_symlink() or latest.exists():
                latest.unlink()
            latest.symlink_to(Path(cfg.out).name)
            log(f"round {r} {shape_name(c)}: {res['reply_tokens']} reply tokens, agreement "
                f"{res.get('agreement', float('nan')):.4f}")
            results.append(dict({k: v for k, v in res.items() if k != "run"}, shape=shape_name(c)))
        if stopped:
            continue
        tmp = state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"round": r + 1, "trained_tokens": results[0]["reply_tokens"],
                                   "history": state.get("history", []) + [results]}, indent=1))
        os.replace(tmp, state_file)
        if finished:
            return
