"""Train a Speculative-Streaming draft by distillation from the target (docs/ss_draft.md).

The target writes the data (its greedy continuations of corpus openings, or replies to chats), so
the draft learns what the target will say; hard labels suffice, since verification at temperature 0
accepts a draft token iff it is the target's argmax. Checkpoints go to OUT/checkpoint, and an
interrupted run resumes exactly: the batch of step s depends on (seed, s) only.
"""

import json
import math
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _download, load_config
from tqdm import tqdm

from mirror_mlx.corpus import HELD_OUT_PARAGRAPHS, paragraphs, split
from mirror_mlx.loading import mlx_lm_load
from mirror_mlx.drafts.tokenizer import folder_tokenizer, tokenizer_mismatch
from mirror_mlx.engine.model_parts import flat
from mirror_mlx.drafts.ss.model import MODEL_TYPE, Model, ModelArgs, config_args, new_model, save_ss_draft, ss_forward

STREAM_WEIGHT = 0.1  # α_j for every stream, α₀ = 1 (docs/design.md §5.7)


class TrainError(ValueError):
    """Bad input to train-draft; the CLI shows it as a usage error."""


@dataclass
class TrainConfig:
    model: str  # the target: a local folder or a Hugging Face repo
    out: str
    corpus: str
    layers: Optional[int] = None  # draft shape; taken from --init-from when given
    hidden: Optional[int] = None
    streams: int = 3
    stream_layers: int = 2
    steps: int = 2000
    batch_size: int = 32
    lr: float = 2e-3
    seed: int = 0
    init_from: Optional[str] = None
    samples: int = 2048  # target continuations to generate
    seq_len: int = 128  # opening + continuation, in tokens
    prompt_min: int = 4  # opening length range, in tokens (BOS included)
    prompt_max: int = 24
    holdout: int = HELD_OUT_PARAGRAPHS  # the corpus's first paragraphs, never trained on (corpus.split)
    checkpoint_every: int = 200


@dataclass
class Data:
    tokens: np.ndarray  # (N, seq_len) int32: opening, then the target's greedy continuation
    start: np.ndarray  # (N,) index of the first target-written token (labels start there)
    length: np.ndarray  # (N,) tokens up to and including the first EOS (labels stop there)


def read_corpus(path: str) -> str:
    """The corpus text (paragraphs separated by blank lines); errors say what is wrong with the file."""
    p = Path(path)
    if not p.is_file():
        raise TrainError(f"corpus {path} does not exist or is not a file")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise TrainError(f"corpus {path} is not UTF-8 text (bad byte at offset {e.start}); "
                         "convert it, e.g. with iconv -t utf-8") from None
    if not paragraphs(text):
        raise TrainError(f"corpus {path} is empty: it needs paragraphs of text separated by blank lines")
    return text


def read_chats(path: str) -> list[list[dict]]:
    """A .jsonl corpus: one conversation per line, {"messages": [{"role": ..., "content": ...}, ...]}
    (a trailing assistant turn is dropped: the target writes the reply)."""
    p = Path(path)
    if not p.is_file():
        raise TrainError(f"corpus {path} does not exist or is not a file")
    chats = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
            if not (isinstance(messages, list) and messages
                    and all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)):
                raise ValueError
        except (ValueError, KeyError, TypeError, AttributeError):
            raise TrainError(f"corpus {path} line {n} is not a chat: each line of a .jsonl corpus is "
                             '{"messages": [{"role": "user", "content": "..."}, ...]}') from None
        chats.append(messages[:-1] if messages[-1]["role"] == "assistant" and len(messages) > 1 else messages)
    if not chats:
        raise TrainError(f"corpus {path} holds no conversations")
    return chats


def check_config(cfg: TrainConfig) -> None:
    if cfg.streams < 1:
        raise TrainError(f"--streams must be at least 1, got {cfg.streams}")
    if cfg.stream_layers < 1:
        raise TrainError(f"--stream-layers must be at least 1, got {cfg.stream_layers}")
    if cfg.layers is not None and cfg.stream_layers > cfg.layers:
        raise TrainError(f"--stream-layers ({cfg.stream_layers}) cannot exceed --layers ({cfg.layers})")
    if cfg.holdout < 0:
        raise TrainError("--holdout cannot be negative")
    for name in ("steps", "batch_size"):
        if getattr(cfg, name) < 1:
            raise TrainError(f"--{name.replace('_', '-')} must be at least 1")
    if cfg.samples < 10:  # a tenth of them is held out to measure the draft: at least one
        raise TrainError(f"--samples {cfg.samples} leaves none for the held-out tenth: give at least 10")
    if not 2 <= cfg.prompt_min <= cfg.prompt_max < cfg.seq_len:
        raise TrainError("need 2 <= prompt_min <= prompt_max < seq_len")


INIT_TYPES = ("llama", "mistral", MODEL_TYPE)  # model types whose weights an SS draft takes as they are


def init_refusal(config: dict) -> Optional[str]:
    """Why a model folder's weights cannot start an SS draft (a phrase), or None when they can."""
    kind = config.get("model_type")
    if kind not in INIT_TYPES:
        return f"a {kind} model"
    if any(t != "full_attention" for t in config.get("layer_types") or []):  # as mlx-lm's llama reads it
        return "a sliding-window model"
    return None


def draft_args(cfg: TrainConfig, target_dir: Path, target_tok) -> ModelArgs:
    """The draft's shape: that of --init-from, or a narrower/shallower copy of the target's."""
    if cfg.init_from is not None:
        init_dir = Path(cfg.init_from)
        if not (init_dir / "config.json").is_file():
            raise TrainError(f"--init-from {cfg.init_from} is not a model folder (no config.json)")
        why = tokenizer_mismatch(target_tok, folder_tokenizer(init_dir))
        if why is not None:
            raise TrainError(f"--init-from {cfg.init_from} does not share the target's tokenizer "
                             f"({cfg.model}: {why}); a draft must tokenize exactly like its target")
        init_config = load_config(init_dir)
        why = init_refusal(init_config)
        if why is not None:
            raise TrainError(f"--init-from {cfg.init_from} is {why}, but the Speculative-Streaming draft is a plain "
                             "llama decoder: give a llama or mistral model (4/8-bit ones are dequantized) or an SS "
                             "draft, or drop --init-from to train one from scratch (--layers, --hidden set its shape)")
        n_layers = init_config["num_hidden_layers"]
        if cfg.stream_layers > n_layers:
            raise TrainError(f"--stream-layers ({cfg.stream_layers}) cannot exceed the draft's layers "
                             f"({n_layers}, from --init-from)")
        args = config_args(init_dir, num_streams=cfg.streams, stream_layers=cfg.stream_layers)
        for flag, want, have in (("--layers", cfg.layers, args.num_hidden_layers),
                                 ("--hidden", cfg.hidden, args.hidden_size)):
            if want is not None and want != have:
                raise TrainError(f"{flag} {want} disagrees with --init-from ({have}); drop {flag}")
    else:
        t = load_config(target_dir)
        hidden = cfg.hidden or t["hidden_size"]
        head_dim = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
        heads = max(1, hidden // head_dim)
        group = max(1, t["num_attention_heads"] // t.get("num_key_value_heads", t["num_attention_heads"]))
        ratio = t["intermediate_size"] / t["hidden_size"]
        layers = cfg.layers or max(1, t["num_hidden_layers"] // 2)
        if cfg.stream_layers > layers:
            raise TrainError(f"--stream-layers ({cfg.stream_layers}) cannot exceed the draft's layers ({layers})")
        config = dict(t, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // group), head_dim=head_dim,
                      intermediate_size=int(round(ratio * hidden / 4)) * 4, tie_word_embeddings=True,
                      num_streams=cfg.streams, stream_layers=cfg.stream_layers, model_type="ss_llama")
        quantized = ("quantization", "quantization_config")
        args = ModelArgs.from_dict({k: v for k, v in config.items() if k not in quantized})
    if args.vocab_size < len(target_tok.get_vocab()):
        raise TrainError(f"draft vocabulary ({args.vocab_size}) is smaller than the target tokenizer's")
    return args


def target_continuations(target: nn.Module, tokenizer, paragraphs: list, cfg: TrainConfig,
                         progress: bool = True) -> Data:
    """The target's greedy continuations of corpus openings (or replies to chats), generated in batches
    of equal-length openings."""
    rng = np.random.default_rng([cfg.seed, 1])
    B = 64  # generation batch: inference only, so wide; fixed so the data depend on the seed alone
    batches = (chat_batches if paragraphs and isinstance(paragraphs[0], list) else text_batches)(
        tokenizer, paragraphs, cfg, rng, B)
    eos = np.array(sorted(tokenizer.eos_token_ids or []), dtype=np.int64)
    rows, starts = [], []
    for prompt in tqdm(batches, desc="target continuations", disable=not progress):
        p = prompt.shape[1]
        cache = make_prompt_cache(target)
        y = mx.argmax(target(mx.array(prompt), cache=cache)[:, -1], axis=-1)
        out = [y]
        for _ in range(cfg.seq_len - p - 1):
            y = mx.argmax(target(y[:, None], cache=cache)[:, -1], axis=-1)
            out.append(y)
            mx.async_eval(y)
        rows.append(np.concatenate([prompt, np.array(mx.stack(out, axis=1))], axis=1))
        starts += [p] * len(prompt)
    tokens = np.concatenate(rows)[: cfg.samples].astype(np.int32)
    start = np.array(starts[: cfg.samples], dtype=np.int32)
    is_eos = np.isin(tokens, eos) & (np.arange(tokens.shape[1])[None, :] >= start[:, None])
    length = np.where(is_eos.any(1), is_eos.argmax(1) + 1, tokens.shape[1]).astype(np.int32)
    return Data(tokens, start, length)


def text_batches(tokenizer, paragraphs: list[str], cfg: TrainConfig, rng, B: int) -> list[np.ndarray]:
    """Per batch, B paragraphs' openings of one random length in [prompt_min, prompt_max]."""
    encoded = [tokenizer.encode(p) for p in paragraphs]
    lengths = np.array([len(e) for e in encoded])
    batches = []
    for _ in range(math.ceil(cfg.samples / B)):
        p = int(rng.integers(cfg.prompt_min, cfg.prompt_max + 1))
        pool = np.flatnonzero(lengths >= p)
        if len(pool) == 0:
            p = int(lengths.max())
            pool = np.flatnonzero(lengths >= p)
        pick = rng.choice(pool, size=B, replace=len(pool) < B)
        batches.append(np.array([encoded[i][:p] for i in pick], dtype=np.int32))
    return batches


def chat_batches(tokenizer, chats: list[list[dict]], cfg: TrainConfig, rng, B: int) -> list[np.ndarray]:
    """`samples` conversations (each once before any repeats), rendered whole through the chat template
    with its generation prompt, batched by rendered length."""
    if not getattr(tokenizer, "has_chat_template", False):
        raise TrainError("the target's tokenizer has no chat template, which a .jsonl corpus of chats needs: "
                         "give a text corpus instead")
    encoded = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True)) for c in chats]
    longest = max(len(e) for e in encoded)
    if longest >= cfg.seq_len:
        raise TrainError(f"a conversation renders to {longest} tokens, not fewer than --seq-len {cfg.seq_len}: "
                         "raise --seq-len (the reply is what follows) or shorten the conversation")
    order = np.concatenate([rng.permutation(len(encoded)) for _ in range(math.ceil(cfg.samples / len(encoded)))])
    by_length: dict[int, list[list[int]]] = {}
    for i in order[: cfg.samples]:
        by_length.setdefault(len(encoded[i]), []).append(encoded[i])
    return [np.array(group[j:j + B], dtype=np.int32) for _, group in sorted(by_length.items())
            for j in range(0, len(group), B)]


def ss_loss(model: Model, tokens: mx.array, start: mx.array, length: mx.array):
    """(loss, main CE, per-stream CE, per-head top-1 accuracy) over the target-written positions."""
    x = tokens[:, :-1]
    out = ss_forward(model, x)
    T = x.shape[1]
    pos = mx.arange(T)

    def head(logits, ahead):  # logits at row t predict tokens[t + 1 + ahead]
        idx = pos + 1 + ahead
        valid = (idx[None] >= start[:, None]) & (idx[None] < length[:, None])
        target = mx.take(tokens, mx.minimum(idx, T), axis=1)
        n = mx.maximum(valid.sum(), 1)
        ce = (nn.losses.cross_entropy(logits, target) * valid).sum() / n
        acc = ((mx.argmax(logits, -1) == target) * valid).sum() / n
        return ce, acc

    main_ce, main_acc = head(out.main, 0)
    stream = [head(out.streams[:, j], j + 1) for j in range(out.streams.shape[1])]
    stream_ce = mx.stack([c for c, _ in stream])
    loss = main_ce + STREAM_WEIGHT * stream_ce.sum()
    acc = mx.stack([main_acc] + [a for _, a in stream])
    return loss, main_ce, stream_ce, acc


def _batch(data: Data, idx: np.ndarray):
    return mx.array(data.tokens[idx]), mx.array(data.start[idx]), mx.array(data.length[idx])


def evaluate(model: Model, data: Data, batch_size: int = 32) -> dict:
    """Loss and top-1 accuracy of the main row and of each stream on `data`."""
    rows = []
    for i in range(0, len(data.tokens), batch_size):
        idx = np.arange(i, min(i + batch_size, len(data.tokens)))
        loss, main_ce, stream_ce, acc = ss_loss(model, *_batch(data, idx))
        rows.append(np.concatenate([[loss.item(), main_ce.item()], np.array(stream_ce), np.array(acc)]) * len(idx))
    v = np.sum(rows, axis=0) / len(data.tokens)
    S = model.args.num_streams
    return {"loss": float(v[0]), "main_ce": float(v[1]), "stream_ce": v[2:2 + S].round(4).tolist(),
            "main_acc": float(v[2 + S]), "stream_acc": v[3 + S:].round(4).tolist()}


def _schedule(cfg: TrainConfig) -> Callable:
    warm = min(100, max(1, cfg.steps // 10))
    return optim.join_schedules(
        [optim.linear_schedule(cfg.lr / warm, cfg.lr, warm),
         optim.cosine_decay(cfg.lr, max(1, cfg.steps - warm), cfg.lr * 0.1)], [warm])


def _save_checkpoint(ckpt: Path, model: Model, opt: optim.Optimizer, step: int, cfg: TrainConfig) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    arrays = {"model." + k: v for k, v in flat(model.parameters())}
    arrays.update({"opt." + k: v for k, v in flat(opt.state)})
    mx.save_safetensors(str(ckpt / "state.tmp.safetensors"), arrays)
    (ckpt / "state.tmp.safetensors").replace(ckpt / "state.safetensors")
    (ckpt / "progress.json").write_text(json.dumps({"step": step, "config": _run_key(cfg)}, indent=2))


def _run_key(cfg: TrainConfig) -> dict:
    """Everything that determines the run; a checkpoint only resumes a run with the same key."""
    return {k: v for k, v in asdict(cfg).items() if k not in ("out", "checkpoint_every")}


def _train_paragraphs(cfg: TrainConfig) -> list:
    """The corpus's training part: its paragraphs (or conversations) after the held-out ones."""
    train_paragraphs: list  # paragraphs, or conversations (lists of messages)
    if cfg.corpus.endswith(".jsonl"):
        chats = read_chats(cfg.corpus)
        train_paragraphs, count = chats[cfg.holdout:], f"{len(chats)} conversations"
    else:
        text = read_corpus(cfg.corpus)
        train_paragraphs, count = split(text, cfg.holdout).train, f"{len(paragraphs(text))} paragraphs"
    if not train_paragraphs:
        raise TrainError(f"corpus {cfg.corpus} has {count}, not more than --holdout "
                         f"({cfg.holdout}): give a longer corpus or a smaller --holdout")
    return train_paragraphs


def _resumed_step(cfg: TrainConfig, ckpt: Path, log: Callable[[str], None]) -> tuple[int, bool]:
    """(the step a checkpoint of this run reached, whether there is one); a checkpoint of other settings is refused."""
    progress_file = ckpt / "progress.json"
    if not progress_file.is_file():
        return 0, False
    saved = json.loads(progress_file.read_text())
    if saved["config"] != _run_key(cfg):
        raise TrainError(f"{ckpt} holds a run with other settings; use another --out or delete it")
    log(f"resuming from step {saved['step']}")
    return saved["step"], True


def _training_data(cfg: TrainConfig, ckpt: Path, resumed: bool, make: Callable[[], "Data"]) -> "Data":
    """The target's text to train on: the checkpoint's when resuming, else `make()`'s, saved with the checkpoint."""
    if resumed and (ckpt / "data.npz").is_file():
        return Data(**np.load(ckpt / "data.npz"))
    data = make()
    ckpt.mkdir(parents=True, exist_ok=True)
    np.savez(ckpt / "data.npz", **vars(data))
    (ckpt / "progress.json").write_text(json.dumps({"step": 0, "config": _run_key(cfg)}, indent=2))
    return data


def _held_out(data: "Data") -> tuple["Data", "Data"]:
    """(validation samples: a tenth, at most 64; the training samples)."""
    n_val = min(64, len(data.tokens) // 10)
    val = Data(data.tokens[:n_val], data.start[:n_val], data.length[:n_val])
    tr = Data(data.tokens[n_val:], data.start[n_val:], data.length[n_val:])
    if len(tr.tokens) == 0:
        raise TrainError("not enough training samples; raise --samples")
    return val, tr


def train(cfg: TrainConfig, progress: bool = True, log: Callable[[str], None] = print,
          stop_after: Optional[int] = None) -> dict:
    """Run (or resume) a training run; writes the draft folder to cfg.out and returns a summary.

    `stop_after` ends this run after that many steps with a checkpoint and no draft folder (a
    time-boxed run; the same call again resumes it, as an interrupted run resumes from its last one)."""
    check_config(cfg)
    train_paragraphs = _train_paragraphs(cfg)
    try:
        target_dir = _download(cfg.model)
        target, target_tok = mlx_lm_load(str(target_dir))
    except Exception as e:  # not found / not a model: say so plainly
        raise TrainError(f"cannot load target --model {cfg.model}: {e}") from None
    args = draft_args(cfg, target_dir, target_tok)
    out, ckpt = Path(cfg.out), Path(cfg.out) / "checkpoint"

    step, resumed = _resumed_step(cfg, ckpt, log)
    t0 = time.time()
    data = _training_data(cfg, ckpt, resumed, lambda: target_continuations(target, target_tok, train_paragraphs,
                                                                          cfg, progress))
    gen_s = time.time() - t0
    val, tr = _held_out(data)

    mx.random.seed(cfg.seed)
    model = new_model(args, cfg.init_from)
    opt = optim.AdamW(learning_rate=_schedule(cfg), weight_decay=0.01)
    opt.init(model.trainable_parameters())
    if step > 0:
        w = cast(dict[str, mx.array], mx.load(str(ckpt / "state.safetensors")))
        model.load_weights([(k[6:], v) for k, v in w.items() if k.startswith("model.")], strict=True)
        opt.state = tree_unflatten([(k[4:], v) for k, v in w.items() if k.startswith("opt.")])
    before = evaluate(model, val) if step == 0 else None

    loss_and_grad = nn.value_and_grad(model, lambda m, *b: ss_loss(m, *b))
    state = [model.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def train_step(tokens, start, length):
        (loss, main_ce, stream_ce, acc), grads = loss_and_grad(model, tokens, start, length)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss, main_ce, stream_ce

    B = min(cfg.batch_size, len(tr.tokens))
    tok_per_step = B * (tr.tokens.shape[1] - 1)
    bar = tqdm(total=cfg.steps, initial=step, desc="train-draft", disable=not progress,
               dynamic_ncols=True)
    ema, train_t0, steps_run = None, time.time(), 0
    while step < cfg.steps:
        if stop_after is not None and steps_run >= stop_after:
            _save_checkpoint(ckpt, model, opt, step, cfg)
            bar.close()
            return {"stopped_at": step}
        idx = np.random.default_rng([cfg.seed, 2, step]).choice(len(tr.tokens), B, replace=False)
        loss, main_ce, stream_ce = train_step(*_batch(tr, idx))
        mx.eval(state, loss)
        step += 1
        steps_run += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        rate = steps_run * tok_per_step / max(time.time() - train_t0, 1e-9)
        bar.set_postfix(loss=f"{ema:.3f}", main=f"{main_ce.item():.3f}", tok_s=f"{rate:,.0f}")
        bar.update(1)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            _save_checkpoint(ckpt, model, opt, step, cfg)
    bar.close()

    after = evaluate(model, val)
    t = load_config(target_dir)
    extra = {k: t[k] for k in ("bos_token_id", "eos_token_id") if k in t}
    save_ss_draft(model, out, tokenizer_from=target_dir, extra_config=extra)
    summary = {"config": asdict(cfg), "generate_s": round(gen_s, 1),
               "train_s": round(time.time() - train_t0, 1), "steps_this_run": steps_run,
               "final_loss_ema": ema, "val_before": before, "val_after": after}
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
