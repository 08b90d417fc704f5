"""Across ranks, which split: the target tensor-parallel (`model.shard`) against split by layers (mlx-lm's
pipeline split, `--pipeline`), ar, sd and mirror on 2 ranks of this box, with one process as the reference,
in one run.

The target is the demo's widened target (build/stories-98M, `make demo` builds it) written as a qwen2
model, a family that has both splits in mlx-lm: the same weights, zero q/k/v biases, and one more
embedding row (transformers' qwen2 tokenizer adds `<|endoftext|>` as id 512). Its tokenizer is the
qwen2 one transformers builds from the same files, which splits text otherwise, so the prompts go in as
ids of the llama tokenizer. The draft is the demo's llama2xs, written as a qwen2 model the same way (the
draft's tokenizer must be the target's).

`python scripts/split_bench.py [--tokens 48] [--prompts 3]` prints a markdown table (docs/bench/across-macs.md).
"""

import argparse
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mirror_mlx import distributed  # noqa: E402
from mirror_mlx.bench.ranks import rank0_json  # noqa: E402

BUILD = ROOT / "build"
QWEN2 = BUILD / "stories-98M-qwen2"
DRAFT = BUILD / "llama2xs-qwen2"
KNOBS = {"ar": {}, "sd": dict(gamma=3), "mirror": dict(kappa=4, gamma=3, exit_layer=6)}


def as_qwen2(src: Path, dst: Path) -> Path:
    """The llama at `src` as a qwen2 model at `dst` (same logits on the first 512 ids)."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, save_config, save_model

    if (dst / "model.safetensors.index.json").exists():
        return dst
    config = json.loads((src / "config.json").read_text())
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=config["vocab_size"] + 1)
    weights = mx.load(str(src / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = mx.concatenate([embed, mx.zeros((1, embed.shape[1]), embed.dtype)])
    for k in list(weights):
        if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            weights[k.replace(".weight", ".bias")] = mx.zeros((weights[k].shape[0],), weights[k].dtype)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    model.load_weights(list(weights.items()))
    dst.mkdir(parents=True, exist_ok=True)
    save_model(dst, model)
    save_config(config, dst / "config.json")
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        if (src / f).exists():
            shutil.copy(src / f, dst / f)
    return dst


def measure(pipe, prompts: list[list[int]], tokens: int) -> dict:
    """Our modes, and mlx-lm's own `generate_step` on the same (sharded) model: what mlx_lm.chat and
    mlx_lm.server run across ranks, where they take no draft."""
    from mirror_mlx.bench.baselines import run_ar

    run_ar(pipe.model, prompts[0], 8)  # warm
    runs = [run_ar(pipe.model, p, tokens) for p in prompts]
    out = {"mlx_lm": dict(tok_s=sum(len(r.tokens) for r in runs) / sum(r.decode_s for r in runs),
                          ms_per_forward=1e3 * sum(r.decode_s for r in runs) / sum(r.target_forwards for r in runs),
                          tokens_per_forward=1.0, tokens=[r.tokens for r in runs])}
    for mode, knobs in KNOBS.items():
        pipe.generate(prompts[0], max_tokens=8, mode=mode, stop=False, **knobs)  # warm
        n, t, fwd, text = 0, 0.0, 0, []
        for p in prompts:
            r = pipe.generate(p, max_tokens=tokens, mode=mode, stop=False, **knobs)
            n, t, fwd = n + len(r.tokens), t + r.stats.decode_seconds, fwd + r.stats.target_forwards
            text.append(r.tokens)
        out[mode] = dict(tok_s=n / t, ms_per_forward=1e3 * t / fwd, tokens_per_forward=n / fwd, tokens=text)
    return out


def openings(n: int) -> list[list[int]]:
    """The first n held-out paragraphs' first six words, as ids of the widened target's llama tokenizer."""
    from mlx_lm.utils import load_tokenizer

    from mirror_mlx.corpus import load_split

    llama = load_tokenizer(BUILD / "stories-98M")
    return [llama.encode(" ".join(t.split()[:6])) for t in load_split().held_out[:n]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=3)
    args = ap.parse_args()
    if distributed.group() is not None:  # a rank: both splits, one after the other
        got, prompts = {}, openings(args.prompts)
        for split in ("tensor", "pipeline"):
            pipe = distributed.load(QWEN2, DRAFT, "none", pipeline=split == "pipeline")
            try:
                got[split] = measure(pipe, prompts, args.tokens)
            finally:
                pipe.close()
        if distributed.group().rank() == 0:
            print(json.dumps(got), flush=True)
        return
    spec = importlib.util.spec_from_file_location("demo", ROOT / "scripts" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    target, _, _ = demo.widened(BUILD)
    as_qwen2(target, QWEN2)
    as_qwen2(ROOT / "mirror_mlx" / "demo" / "llama2xs", DRAFT)
    prompts = openings(args.prompts)
    import mirror_mlx

    load0 = os.getloadavg()
    from mlx_lm.utils import load

    from mirror_mlx.bench.baselines import best_mlx_sd

    pipe = mirror_mlx.load(QWEN2, DRAFT, exit_adapter="none")
    try:
        single = measure(pipe, prompts, args.tokens)
        sweep = best_mlx_sd(pipe.model, load(str(DRAFT))[0], prompts, args.tokens, ks=(2, 3, 4))
        runs = sweep.runs[sweep.best_k]
        mlx_sd = dict(tok_s=sum(len(r.tokens) for r in runs) / sum(r.decode_s for r in runs), k=sweep.best_k,
                      tokens=[r.tokens for r in runs])
    finally:
        pipe.close()
    dist = rank0_json([sys.executable, __file__, "--tokens", str(args.tokens), "--prompts", str(args.prompts)])
    load1 = os.getloadavg()
    modes = ["mlx_lm", *KNOBS]
    same = all(dist[s][m]["tokens"] == single["ar"]["tokens"] for s in dist for m in modes) and \
        all(single[m]["tokens"] == single["ar"]["tokens"] for m in modes) and mlx_sd["tokens"] == single["ar"]["tokens"]
    print(f"widened demo target as qwen2 (15 layers, hidden 768) + llama2xs as qwen2; {len(prompts)} held-out openings × "
          f"{args.tokens} tokens, greedy; sd γ=3, mirror κ=4 γ=3 ℓe=6; load average {load0[0]:.2f} before, "
          f"{load1[0]:.2f} after; every text equal to one process's ar: {'yes' if same else 'NO'}\n")
    print("| mode | 1 process tok/s | 2 ranks tensor tok/s | 2 ranks pipeline tok/s | pipeline / tensor "
          "| tensor ms/forward | pipeline ms/forward | tokens/forward |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in modes:
        a, t, p = single[mode], dist["tensor"][mode], dist["pipeline"][mode]
        print(f"| {mode} | {a['tok_s']:.1f} | {t['tok_s']:.1f} | {p['tok_s']:.1f} | {p['tok_s'] / t['tok_s']:.2f}x "
              f"| {t['ms_per_forward']:.1f} | {p['ms_per_forward']:.1f} | {p['tokens_per_forward']:.2f} |")
    print(f"| mlx_sd (k={mlx_sd['k']}, one process only: mlx-lm takes no draft across ranks) | {mlx_sd['tok_s']:.1f} "
          "| - | - | - | - | - | - |")
    best = {s: max(dist[s][m]["tok_s"] for m in ("sd", "mirror")) for s in dist}
    print(f"\nOur best mode on 2 ranks against mlx-lm's generation of the same sharded model: tensor "
          f"{best['tensor'] / dist['tensor']['mlx_lm']['tok_s']:.2f}x, pipeline "
          f"{best['pipeline'] / dist['pipeline']['mlx_lm']['tok_s']:.2f}x; against mlx-lm's best in one process "
          f"(mlx_sd): {max(best.values()) / mlx_sd['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
