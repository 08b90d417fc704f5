"""Where a recycled-tree step's time goes on the real model (SmolLM2-135M-Instruct, `make real-pair`), in the Mac
analog (one BLAS thread, every thread of this process on core 0): per step, the tree's forward, the walk, the
top-K the table learns from, keeping the accepted path's cache rows, and the shape and table work on the
calling thread; beside them a one-row forward of the same cache.

    .venv/bin/python scripts/benchmarks/tree_step.py [--warm 4] [--prompts 4] [--max-tokens 64]

The table is warmed on Spec-Bench training-part prompts first; the steps timed are on evaluation-part ones
(every 15th), the tree alone (lookup=False), T = 0. Each phase is evaluated before the next starts, so the
phases add up to a step's verify.
"""

import argparse
import os
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import mirror_mlx  # noqa: E402,F401  (OpenBLAS before mlx.core)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import trim_prompt_cache  # noqa: E402

from mirror_mlx.engine import target, tree as trees  # noqa: E402
from mirror_mlx.proposers import recycle  # noqa: E402
from mirror_mlx.pipeline import load  # noqa: E402
from mirror_mlx.prompts import spec_bench_part  # noqa: E402

spent: dict[str, float] = {}


def timed(name: str, t0: float) -> float:
    t1 = time.perf_counter()
    spent[name] = spent.get(name, 0.0) + t1 - t0
    return t1


def verify_tree(self, history, tree, sampler, processors, k):
    """TargetSide.verify_tree with each phase evaluated and timed apart."""
    t = time.perf_counter()
    before = None if tree.is_chain else self.cache[0].offset
    logits = trees.forward(self.model, self.cache, tree)
    mx.eval(logits)
    t = timed("forward", t)
    out = trees.walk(logits, tree, history, sampler, processors)
    t = timed("walk", t)
    top = target.top_ids(logits, k)
    mx.eval(top, out.logprobs)
    t = timed("top-K", t)
    if before is None:
        trim_prompt_cache(self.cache, len(tree) - 1 - len(out.path))
    else:
        trees.keep_path(self.cache, before, [0] + out.path)
    mx.eval([c.keys for c in self.cache])
    timed("keep path", t)
    spent["rows"] = spent.get("rows", 0) + len(tree)
    spent["trees"] = spent.get("trees", 0) + 1
    self.cached = list(history) + out.tokens[:-1]
    self.logprobs = out.logprobs
    return out, np.array(top)


def caller_side(cls, name: str):
    """A Recycled method timed on the calling thread (the engine's loop)."""
    plain = getattr(cls, name)

    def wrapped(*args, **kwargs):
        t = time.perf_counter()
        try:
            return plain(*args, **kwargs)
        finally:
            timed(f"{name} (caller)", t)

    setattr(cls, name, wrapped)


def one_row(side) -> float:
    t = time.perf_counter()
    mx.eval(side.model(mx.array([[side.cached[-1]]]), cache=side.cache))
    seconds = time.perf_counter() - t
    trim_prompt_cache(side.cache, 1)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warm", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {0})
    target.TargetSide.verify_tree = verify_tree
    caller_side(recycle.Recycled, "grow")
    caller_side(recycle.Recycled, "learn")
    pipe = load("build/real-pair/target", draft_model="recycle")
    chat = lambda p: pipe.tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": p.text[:1500]}], add_generation_prompt=True)
    try:
        for p in spec_bench_part("train")[::10][: args.warm]:
            pipe.generate(chat(p), max_tokens=args.max_tokens, lookup=False)
        spent.clear()
        steps = tokens = 0
        singles = []
        for p in spec_bench_part("eval")[::15][: args.prompts]:
            s = pipe.generate(chat(p), max_tokens=args.max_tokens, lookup=False).stats
            steps, tokens = steps + s.steps, tokens + s.generation_tokens
            singles += [pipe.engine.target_worker.call(one_row, pipe.engine.target) for _ in range(5)]
    finally:
        pipe.close()
    rows, n = spent.pop("rows"), spent.pop("trees")
    print(f"{args.prompts} prompts × {args.max_tokens} tokens: {steps} steps ({n} trees), {tokens / steps:.2f} tokens "
          f"a step, {rows / n:.1f} rows a tree; one-row forward {1e3 * sorted(singles)[len(singles) // 2]:.1f} ms")
    for name, seconds in spent.items():
        print(f"  {name:16s} {1e3 * seconds / n:6.1f} ms a tree")


if __name__ == "__main__":
    main()
