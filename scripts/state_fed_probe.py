"""Which draft agrees more with the target on the same replies: the self-draft (the target's first layers, one
trained layer, the trimmed head) or a draft fed the target's own hidden state (EAGLE's shape: one layer over the
next token's embedding and the target's state at the previous position).

    python scripts/state_fed_probe.py states --ids data/distill/smollm2-135m-instruct.npz --out build/probe
    python scripts/state_fed_probe.py train --states build/probe --feed self6      # the self-draft's shape
    python scripts/state_fed_probe.py train --states build/probe --feed h30        # fed the last layer's state

`states` prefills every packed reply once (teacher forcing, as `mirror-mlx distill restore` does; each distinct
prompt once, its replies on its cache) and keeps, per reply, the target's top-32 logits at the reply's positions
and its hidden state after blocks 3, 6, 15 and 30 (float16; ~1.1 MB per reply for SmolLM2-135M: recomputable,
never committed). `train` fits one decoder layer to the soft top-32 labels on the training replies and prints,
after each epoch, teacher-forced agreement (the draft's argmax equals the target's) on the evaluation part's
greedy replies (keys `eval-*`): acc1 is the first drafted token (fed the target's true state); acc2 the second,
fed the draft's own state (`--feed h*` only); chain2 both in a row. Prompt tokens are context only; reply
positions carry the loss. `--limit-files N` trains on the first N training replies, every prompt's greedy reply
first, then every prompt's first sample, and so on, so that a prefix of the data spans as many prompts as it can.
"""

import argparse
import json
import time
from pathlib import Path

import mirror_mlx  # noqa: F401  (the BLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.models.llama import ModelArgs, TransformerBlock

from mirror_mlx.drafts.distilled.model import new_draft, save_trained
from mirror_mlx.engine.model_parts import flat
from mirror_mlx.loading import mlx_lm_load
from mirror_mlx.train.distill_data import unpack_ids

TAPS = (3, 6, 15, 30)
TOP_K = 32


def head(model, h):
    inner = model.model
    if getattr(model.args, "tie_word_embeddings", True):
        return inner.embed_tokens.as_linear(inner.norm(h))
    return model.lm_head(inner.norm(h))


def by_round(key: str) -> tuple:
    """Every prompt's first reply before any prompt's second, so the first N replies span the most prompts:
    keys read `source-index-tT-sS-hash` (S the sample, 0 greedy)."""
    source, index, t, s = key.split("-")[:4]
    return (not key.startswith("eval"), int(s[1:]), t, source, index)


def forward(model, tokens: np.ndarray, cache) -> tuple[mx.array, dict]:
    """The target over `tokens` after what `cache` holds: its last state and its states at TAPS."""
    h = model.model.embed_tokens(mx.array(tokens.astype(np.int32))[None])
    mask = create_attention_mask(h, cache[0])
    taps = {}
    for i, (layer, c) in enumerate(zip(model.model.layers, cache), 1):
        h = layer(h, mask, c)
        if i in TAPS:
            taps[i] = h[0]
    mx.eval(h, *taps.values())
    return h, taps


def states(args) -> None:
    """One .npz per packed reply: prompt, reply, the target's top-32 ids/logits and hidden states at TAPS.

    Each distinct prompt is prefilled once; each of its replies then runs on the prompt's cache, which is
    trimmed back to the prompt after it (most replies share their prompt with several others)."""
    model, _ = mlx_lm_load(args.target)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[bytes, list] = {}
    for key, prompt, reply in sorted(unpack_ids(Path(args.ids)), key=lambda e: by_round(e[0])):
        if not (out / f"{key}.npz").exists():
            groups.setdefault(prompt.tobytes(), []).append((key, prompt, reply))
    t0, n = time.time(), 0
    for todo in groups.values():
        prompt = todo[0][1]
        cache = make_prompt_cache(model)
        h, prompt_taps = forward(model, prompt, cache)
        last = head(model, h[:, -1:])  # the logits that predict each reply's first token
        for key, _, reply in todo:
            h, taps = forward(model, reply, cache)
            trim_prompt_cache(cache, len(reply))
            rows = mx.concatenate([last, head(model, h[:, :-1])], axis=1)[0]  # the reply's last token predicts none
            ids = mx.argpartition(-rows, TOP_K - 1, axis=-1)[:, :TOP_K]
            vals = mx.take_along_axis(rows, ids, axis=-1)
            order = mx.argsort(-vals, axis=-1)
            ids, vals = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
            mx.eval(ids, vals)
            both = {i: np.concatenate([np.array(v.astype(mx.float16)) for v in (prompt_taps[i], taps[i])])
                    for i in TAPS}
            tmp = out / f"{key}.tmp.npz"
            np.savez(tmp, prompt=prompt, reply=reply, top_ids=np.array(ids).astype(np.int32),
                     top_logits=np.array(vals).astype(np.float16), **{f"h{i}": v for i, v in both.items()})
            tmp.rename(out / f"{key}.npz")
            n += len(reply)
            print(f"{key}: {len(reply)} reply tokens, {n / (time.time() - t0):.0f} tokens/s", flush=True)


class Draft(nn.Module):
    """Decoder layers (copied from the target's layers `inits`) and the target's norm over a trimmed head.
    Self-fed (`selfE`): its input is the target's state after layer E at the same position, and its layers start
    from the target's layers E, E+1, ... State-fed: a linear layer over [the token's embedding, the fed states at
    the previous position], initialised to their sum, then one layer started from the target's last."""

    def __init__(self, target, cfg: ModelArgs, n_fed: int, inits: list[int], kept: np.ndarray):
        super().__init__()
        d = cfg.hidden_size
        self.n_fed = n_fed
        if n_fed:
            w = np.zeros((d, d + n_fed * d), np.float32)
            w[:, :d] = np.eye(d)
            w[:, -d:] = np.eye(d)
            self.fc = nn.Linear(d + n_fed * d, d, bias=False)
            self.fc.weight = mx.array(w)
        self.layers = [TransformerBlock(cfg) for _ in inits]
        for layer, i in zip(self.layers, inits):
            layer.update(target.model.layers[i].parameters())
        self.norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.norm.update(target.model.norm.parameters())
        self._embed = target.model.embed_tokens  # frozen: not a child module, so never trained
        self._head = mx.array(np.array(target.model.embed_tokens.weight)[kept])

    def hidden(self, tokens: mx.array, feats: mx.array) -> mx.array:
        x = feats
        if self.n_fed:
            x = self.fc(mx.concatenate([mx.stop_gradient(self._embed(tokens)), feats], -1))
        mask = create_attention_mask(x, None)
        for layer in self.layers:
            x = layer(x, mask, None)
        return x

    def logits(self, h: mx.array) -> mx.array:
        return self.norm(h) @ self._head.T


def kept_ids(replies: list, size: int, always: list, vocab: int) -> np.ndarray:
    """The trimmed head's ids: the `size` most frequent in the training replies, `always` among them."""
    counts = np.bincount(np.concatenate(replies), minlength=vocab)
    counts[[int(t) for t in np.atleast_1d(always)]] += 10**9
    return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int32)


def save_self_draft(target, target_dir: str, frozen: int, kept: np.ndarray, weights: dict, out: str,
                    meta: dict) -> None:
    """The self-draft's trained layers and norm (`Draft`'s weights, over the target's first `frozen` layers) as
    the product's shipped part: the file `mirror-mlx real-pair` builds the draft from (`from_trained`)."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    trained = 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("layers."))
    part = new_draft(target, config, frozen, trained, kept)

    def name(k: str) -> str:
        if k == "norm.weight":
            return "model.norm.weight"
        _, j, rest = k.split(".", 2)
        return f"model.layers.{frozen + int(j)}.{rest}"

    named = {name(k): v for k, v in weights.items()}
    assert set(named) <= {k for k, _ in flat(part.parameters())}, sorted(named)
    part.load_weights(list(named.items()), strict=False)
    save_trained(part, Path(out), {k: str(v) for k, v in meta.items()})


def train(args) -> None:
    target, _ = mlx_lm_load(args.target)
    cfg = ModelArgs.from_dict(json.loads((Path(args.target) / "config.json").read_text()))
    frozen = int(args.feed.removeprefix("self")) if args.feed.startswith("self") else 0
    keys = [f"h{frozen}"] if frozen else args.feed.split(",")
    n_fed = 0 if frozen else len(keys)

    def read(files):
        out = []
        for f in files:
            z = np.load(f)
            out.append(dict(p=len(z["prompt"]), s=np.concatenate([z["prompt"], z["reply"]]).astype(np.int32),
                            top_ids=z["top_ids"], top_logits=z["top_logits"],
                            feats=np.concatenate([z[k] for k in keys], -1)))
        return out

    files = sorted(Path(args.states).glob("*.npz"), key=lambda f: by_round(f.name))
    train_set = read([f for f in files if not f.name.startswith("eval-")][: args.limit_files])
    evals = read([f for f in files if f.name.startswith("eval-")][: args.eval_files])
    n_train = sum(len(e["top_ids"]) for e in train_set)
    print(f"train: {len(train_set)} replies, {n_train} reply tokens; eval: {len(evals)} replies", flush=True)
    kept = kept_ids([e["s"][e["p"]:] for e in train_set], args.vocab, args.eos, cfg.vocab_size)
    row_of = np.full(cfg.vocab_size, -1, np.int64)
    row_of[kept] = np.arange(len(kept))
    inits = list(range(frozen, frozen + args.trained)) if frozen else [len(target.model.layers) - 1]
    draft = Draft(target, cfg, n_fed, inits, kept)

    def batch(exs):
        T, B = max(len(e["s"]) for e in exs), len(exs)
        tokens = np.zeros((B, T), np.int32)
        feats = np.zeros((B, T, exs[0]["feats"].shape[1]), np.float32)
        rows, w = np.zeros((B, T, TOP_K), np.int32), np.zeros((B, T, TOP_K), np.float32)
        m, top1 = np.zeros((B, T), bool), np.full((B, T), -1, np.int64)
        for b, e in enumerate(exs):
            n = len(e["s"])
            tokens[b, :n] = e["s"]
            f = e["feats"].astype(np.float32)
            if n_fed:
                feats[b, 1:n] = f[:n - 1]  # position j is fed the target's state at j-1
            else:
                feats[b, :n] = f
            pos = slice(e["p"] - 1, e["p"] - 1 + len(e["top_ids"]))
            r = row_of[e["top_ids"]]
            lg = np.where(r >= 0, e["top_logits"].astype(np.float32), -np.inf)  # the teacher over the kept ids
            top = lg.max(-1, keepdims=True)
            ok = np.isfinite(top[:, 0])
            p = np.where(ok[:, None], np.exp(lg - np.where(ok[:, None], top, 0)), 0)
            rows[b, pos], w[b, pos] = np.maximum(r, 0), p / np.maximum(p.sum(-1, keepdims=True), 1e-30)
            m[b, pos], top1[b, pos] = ok, e["top_ids"][:, 0]
        idx = np.flatnonzero(m.reshape(-1))
        return (mx.array(tokens), mx.array(feats), mx.array(rows.reshape(-1, TOP_K)[idx]),
                mx.array(w.reshape(-1, TOP_K)[idx]), mx.array(idx.astype(np.int32)), top1.reshape(-1)[idx])

    def two_pass(model, tokens, feats):
        h1 = model.hidden(tokens, feats)
        if not n_fed:
            return h1, None
        own = mx.concatenate([mx.zeros_like(h1[:, :1]), h1[:, :-1]], 1)  # the second token: its own state at j-1
        own = mx.concatenate([mx.zeros_like(own)] * (n_fed - 1) + [own], -1)
        return h1, model.hidden(tokens, own)

    def at(h, idx):
        return h.reshape(-1, h.shape[-1])[idx]

    def ce(logits, rows, w):
        return -(w * mx.take_along_axis(nn.log_softmax(logits, axis=-1), rows, axis=-1)).sum(-1).mean()

    def loss_fn(model, tokens, feats, rows, w, idx):
        h1, h2 = two_pass(model, tokens, feats)
        loss = ce(model.logits(at(h1, idx)), rows, w)
        return loss if h2 is None else loss + ce(model.logits(at(h2, idx)), rows, w)

    def groups(exs, rng):
        order = sorted(range(len(exs)), key=lambda i: len(exs[i]["s"]) + rng.random())
        out, cur, longest = [], [], 0
        for i in order:
            n = len(exs[i]["s"])
            if cur and max(longest, n) * (len(cur) + 1) > args.batch_tokens:
                out.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n)
        out += [cur] if cur else []
        rng.shuffle(out)
        return out

    def evaluate():
        hit1 = hit2 = both = n = 0
        for g in groups(evals, np.random.default_rng(0)):
            tokens, feats, _, _, idx, top1 = batch([evals[i] for i in g])
            h1, h2 = two_pass(draft, tokens, feats)
            c1 = kept[np.array(mx.argmax(draft.logits(at(h1, idx)), -1))] == top1
            hit1, n = hit1 + int(c1.sum()), n + len(top1)
            if h2 is not None:
                c2 = kept[np.array(mx.argmax(draft.logits(at(h2, idx)), -1))] == top1
                nxt = np.array(idx)[1:] == np.array(idx)[:-1] + 1
                hit2, both = hit2 + int(c2.sum()), both + int((c2[1:] & c1[:-1] & nxt).sum())
        return dict(acc1=round(hit1 / n, 4), acc2=round(hit2 / n, 4), chain2=round(both / n, 4), positions=n)

    mx.random.seed(0)
    opt = optim.Adam(learning_rate=args.lr)
    step_fn = nn.value_and_grad(draft, loss_fn)
    rng, t0 = np.random.default_rng(0), time.time()
    print("before training", evaluate(), flush=True)
    for epoch in range(1, args.epochs + 1):
        for g in groups(train_set, rng):
            tokens, feats, rows, w, idx, _ = batch([train_set[i] for i in g])
            loss, grads = step_fn(draft, tokens, feats, rows, w, idx)
            opt.update(draft, grads)
            mx.eval(draft.parameters(), opt.state, loss)
        scores = evaluate()
        print(f"epoch {epoch} ({n_train} reply tokens, {time.time() - t0:.0f} s)", scores, flush=True)
    if args.save and n_fed:
        draft.save_weights(args.save)
    elif args.save:
        shape = (f"E{frozen} k{args.trained} V{args.vocab}: the target's first {frozen} layers, {args.trained} "
                 f"started from its layers {inits[0]}-{inits[-1]}, its norm; loss: KL to the target's top-{TOP_K} "
                 "logits over the kept ids")
        meta = dict(replies=len(train_set), reply_tokens=n_train, epochs=args.epochs, agreement=scores["acc1"],
                    agreement_positions=scores["positions"], shape=shape)
        save_self_draft(target, args.target, frozen, kept, dict(flat(draft.parameters())), args.save, meta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("states", help="prefill every packed reply and keep the target's states and top-32 logits")
    s.add_argument("--target", default="build/real-pair/target")
    s.add_argument("--ids", default="data/distill/smollm2-135m-instruct.npz")
    s.add_argument("--out", default="build/probe")
    t = sub.add_parser("train", help="train the draft's layers and print its agreement after each epoch")
    t.add_argument("--target", default="build/real-pair/target")
    t.add_argument("--states", default="build/probe")
    t.add_argument("--feed", default="self6", help="selfE (E = 3 or 6: the target's first E layers under the "
                   "trained ones), or the fed states: h30, h15, h3,h15,h30 ...")
    t.add_argument("--trained", type=int, default=1, help="selfE: layers trained over the first E (from the "
                   "target's E, E+1, ...)")
    t.add_argument("--vocab", type=int, default=8192, help="the trimmed head: the most frequent reply ids")
    t.add_argument("--eos", type=int, nargs="*", default=[2], help="ids the trimmed head always keeps")
    t.add_argument("--epochs", type=int, default=4)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--batch-tokens", type=int, default=1024)
    t.add_argument("--limit-files", type=int, default=None,
                   help="the first N training replies, every prompt's greedy reply first (the curve)")
    t.add_argument("--eval-files", type=int, default=40)
    t.add_argument("--save", default=None, help="write the trained draft here: self6 as the shipped part "
                   "real-pair builds its draft from (from_trained), a state-fed draft as its weights")
    args = ap.parse_args()
    if args.cmd == "train" and args.feed.startswith("self") and args.feed.removeprefix("self") not in map(str, TAPS):
        layers = ", ".join(map(str, TAPS))
        ap.error(f"--feed {args.feed}: the states hold the target's state after layers {layers} only")
    if args.cmd == "train" and args.trained != 1 and not args.feed.startswith("self"):
        ap.error("--trained is for a self-draft (--feed selfE): a state-fed draft trains one layer")
    states(args) if args.cmd == "states" else train(args)


if __name__ == "__main__":
    main()
