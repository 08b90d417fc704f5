"""The distilled draft's data: the target's own replies to chat prompts, batched, cached per reply, resumable
(mirror_mlx/train/distill.py trains on them; its docstring says the whole way)."""

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import BatchKVCache
from mirror_mlx.loading import mlx_lm_load as load
from tqdm import tqdm

from mirror_mlx.corpus import distinct_openings, eos_ids, load_split
from mirror_mlx.prompts import DATA, jsonl, spec_bench_part
from mirror_mlx.tune.profile import cache_dir

TOP_K = 32  # teacher logits kept per reply position
MAX_PROMPT = 1536  # longer rendered prompts are skipped (a few Spec-Bench rag/summarization ones)
PREFILL_TOKENS = 6144  # rows x padded prompt length per batch (bounds the prefill's attention memory)
SOURCES = ("eval", "spec_bench", "code_edit", "self", "tinystories")  # self: the target's own questions
TRAIN_SOURCES = SOURCES[1:]


def distill_dir() -> Path:
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


def source_prompts(source: str, tinystories_n: int = 1000, questions: Optional[str] = None) -> list[str]:
    """The user messages of one source, in a fixed order (`self`: the questions file's, none without one)."""
    if source == "self":
        return [q["text"] for q in read_questions(Path(questions))] if questions is not None else []
    if source in ("eval", "spec_bench"):
        return [p.text for p in spec_bench_part("eval" if source == "eval" else "train")]
    if source == "code_edit":
        return [p.text for p in jsonl(DATA / "code_edit.jsonl")]
    if source == "tinystories":
        openings = distinct_openings(load_split().train)[:tinystories_n]
        return [f"Write a short story for children that begins with: \"{o}\"" for o in openings]
    raise ValueError(f"unknown data source {source!r}: use one of {', '.join(SOURCES)}")


def read_questions(path: Path) -> list[dict]:
    """A `distill questions` file's lines ({"seed": s, "text": ...}), in order; [] when there is none yet."""
    path = Path(path)
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()] \
        if path.is_file() else []
    out = []
    for n, line in lines:
        try:
            q = json.loads(line)
        except json.JSONDecodeError:
            q = None
        if not (isinstance(q, dict) and isinstance(q.get("seed"), int) and isinstance(q.get("text"), str)):
            raise ValueError(f"{path} line {n} is not a {{\"seed\": int, \"text\": str}} object: give a file "
                             "`mirror-mlx distill questions` wrote")
        out.append(q)
    return out


ROUND0 = ((0.0, 0), (0.7, 1), (1.0, 1))  # (temperature, seed) of each prompt's first round


def round_variants(r: int) -> tuple:
    """The (temperature, seed) replies round `r` adds per training prompt: greedy and one sample at each
    temperature first, then one more sample at each temperature per round."""
    return ROUND0 if r == 0 else ((0.7, r + 1), (1.0, r + 1))


def schedule(rounds: int = 4, tinystories_n: int = 1000, sources: Sequence[str] = SOURCES,
             prompts: Optional[dict] = None, questions: Optional[str] = None) -> list[list[Job]]:
    """Phases in the order they are worth generating: the evaluation replies (greedy), then the chat training
    sources round by round (round 0: greedy, T=0.7 and T=1.0; later rounds: new samples at both), then the
    TinyStories openings round by round.
    `prompts` ({source: [user message, ...]}) replaces the packaged prompts (tests, custom sets); `questions`, a
    `distill questions` file, is the source `self` either way."""
    if prompts is None:
        prompts = {s: source_prompts(s, tinystories_n, questions) for s in sources}
    elif questions is not None:
        prompts = dict(prompts, self=source_prompts("self", questions=questions))
    phases = [[Job("eval", i, t, 0.0, 0) for i, t in enumerate(prompts.get("eval", []))]]
    chat = [s for s in prompts if s not in ("eval", "tinystories")]
    for group in (chat, [s for s in prompts if s == "tinystories"]):  # stories are furthest from chat: last
        for r in range(rounds + 1):
            for s in group:
                phases.append([Job(s, i, t, temp, seed) for i, t in enumerate(prompts[s])
                               for temp, seed in round_variants(r)])
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
    ids: Optional[str] = None  # a `pack_ids` file: its replies count as made (another machine made them)
    questions: Optional[str] = None  # a `distill questions` file: the source `self` (train/questions.py)


def data_root(target: str, data_dir: Optional[str] = None) -> Path:
    return Path(data_dir) if data_dir else distill_dir() / target_tag(Path(target))


def generate_data(cfg: DataConfig, progress: bool = True, log: Callable[[str], None] = print,
                  stop_after_s: Optional[float] = None, model=None, tokenizer=None) -> dict:
    """Generate every missing reply of the schedule into DATA/replies (one .npz each). Returns counts."""
    if model is None:
        model, tokenizer = load(cfg.target)
    root = data_root(cfg.target, cfg.data_dir)
    replies = root / "replies"
    replies.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in asdict(cfg).items() if k != "prompts"}
    (root / "data.json").write_text(json.dumps(settings, indent=2, default=list))
    eos = eos_ids(tokenizer)
    packed = {key for key, _, _ in unpack_ids(Path(cfg.ids))} if cfg.ids else set()
    phases = [[j for j in phase if j.key not in packed and not (replies / f"{j.key}.npz").exists()]
              for phase in schedule(cfg.rounds, cfg.tinystories, cfg.sources, cfg.prompts, cfg.questions)]
    phases = [p for p in phases if p]
    total = sum(len(p) for p in phases)
    log(f"distill data: {root} ({total} replies to generate" + (f"; {len(packed)} packed in {cfg.ids} count as made)"
                                                                if cfg.ids else ")"))
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


# ------------------------------------------------------------------- token ids that outlive a machine


def pack_ids(root: Path, out: Path) -> dict:
    """Every cached reply of `root` as token ids only, in one compact file (uint16 where the vocabulary fits,
    else int32; prompts stored once per distinct prompt): what a repository keeps so another machine resumes.
    Replies an existing `out` holds and the cache lacks are kept, so the file only grows across machines.
    The teacher's top-K logits are not kept: `restore_ids` recomputes them by batched prefill."""
    files = sorted(p for p in (Path(root) / "replies").glob("*.npz") if not p.name.endswith(".tmp.npz"))
    entries: dict[str, tuple[tuple[int, ...], np.ndarray]] = {}
    for p in files:
        with np.load(p) as z:
            entries[p.stem] = tuple(int(t) for t in z["prompt"]), z["reply"].astype(np.int64)
    kept = 0
    if Path(out).exists():
        for key, prompt_ids, reply_ids in unpack_ids(Path(out)):
            if key not in entries:
                entries[key] = tuple(int(t) for t in prompt_ids), reply_ids.astype(np.int64)
                kept += 1
    keys, prompt_of, replies = [], [], []
    prompts: dict[tuple[int, ...], int] = {}  # a prompt → its index
    for key in sorted(entries):
        prompt, reply = entries[key]
        keys.append(key)
        prompt_of.append(prompts.setdefault(prompt, len(prompts)))
        replies.append(reply)
    flat_prompts = [np.array(p, np.int64) for p in prompts]
    top = max([int(a.max(initial=0)) for a in flat_prompts + replies] + [0])
    dtype = np.uint16 if top < 2**16 else np.int32

    def ragged(arrays):
        offsets = np.cumsum([0] + [len(a) for a in arrays]).astype(np.int64)
        return (np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)), offsets

    p_ids, p_off = ragged(flat_prompts)
    r_ids, r_off = ragged(replies)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, keys=np.array(keys), prompt_ids=p_ids, prompt_offsets=p_off,
                        reply_prompt=np.array(prompt_of, np.int32), reply_ids=r_ids, reply_offsets=r_off)
    os.replace(tmp, out)
    return {"replies": len(keys), "kept_from_file": kept, "prompts": len(prompts), "reply_tokens": int(len(r_ids)),
            "bytes": out.stat().st_size}


def unpack_ids(path: Path) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(key, prompt ids, reply ids) of each reply in a `pack_ids` file."""
    with np.load(path) as z:
        p_ids, p_off, r_ids, r_off = z["prompt_ids"], z["prompt_offsets"], z["reply_ids"], z["reply_offsets"]
        keys, which = [str(k) for k in z["keys"]], z["reply_prompt"]
    return [(k, p_ids[p_off[w]:p_off[w + 1]].astype(np.int32), r_ids[r_off[i]:r_off[i + 1]].astype(np.int32))
            for i, (k, w) in enumerate(zip(keys, which))]


def teacher_forced(model: nn.Module, pairs: Sequence[tuple[np.ndarray, np.ndarray]], top_k: int = TOP_K) -> list[Reply]:
    """The target's top-K ids and logits at every reply position of each (prompt, reply), by one batched,
    left-padded forward over prompt + reply[:-1] (what `batched_replies` recorded while it decoded)."""
    seqs = [np.concatenate([p, r[:-1]]) for p, r in pairs]
    longest = max(len(s) for s in seqs)
    x = mx.array(np.stack([np.pad(s, (longest - len(s), 0)) for s in seqs]).astype(np.int32))

    cache = [BatchKVCache([longest - len(s) for s in seqs]) for _ in range(len(model.layers))]
    logits = model(x, cache=cache)
    out = []
    for b, (p, r) in enumerate(pairs):
        rows = logits[b, longest - len(r):].astype(mx.float32)  # the rows that predict reply[0..R-1]
        ids = mx.argpartition(-rows, top_k - 1, axis=-1)[:, :top_k]
        vals = mx.take_along_axis(rows, ids, axis=-1)
        order = mx.argsort(-vals, axis=-1)
        ids, vals = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
        mx.eval(ids, vals)
        out.append(Reply(p.astype(np.int32), r.astype(np.int32), np.array(ids).astype(np.int32),
                         np.array(vals).astype(np.float16)))
    return out


def restore_ids(path: Path, root: Path, model: nn.Module, batch_tokens: int = PREFILL_TOKENS,
                log: Callable[[str], None] = print, progress: bool = True) -> dict:
    """Write each reply of a `pack_ids` file that `root` lacks, its teacher logits recomputed by batched
    prefill. Returns counts and the prefill rate."""
    replies = Path(root) / "replies"
    replies.mkdir(parents=True, exist_ok=True)
    todo = sorted((e for e in unpack_ids(path) if not (replies / f"{e[0]}.npz").exists()),
                  key=lambda e: len(e[1]) + len(e[2]))
    log(f"distill restore: {len(todo)} replies from {path} into {root}")
    t0, tokens, i = time.time(), 0, 0
    bar = tqdm(total=len(todo), desc="teacher prefill", unit="reply", disable=not progress)
    while i < len(todo):
        n = 1
        while i + n < len(todo) and (n + 1) * (len(todo[i + n][1]) + len(todo[i + n][2])) <= batch_tokens:
            n += 1
        batch = todo[i:i + n]
        for (key, _, _), r in zip(batch, teacher_forced(model, [(p, r) for _, p, r in batch])):
            save_reply(replies / f"{key}.npz", r)
        tokens += sum(len(p) + len(r) for _, p, r in batch)
        i += n
        bar.update(n)
        bar.set_postfix(tok_s=f"{tokens / max(1e-9, time.time() - t0):.0f}")
    bar.close()
    seconds = time.time() - t0
    return {"restored": len(todo), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9)}
