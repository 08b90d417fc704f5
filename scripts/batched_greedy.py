"""How often batched decoding flips a greedy token: the held-out TinyStories openings decoded alone
(`Pipeline.generate`, mode ar) and together in mlx-lm's BatchGenerator (as `mirror-mlx serve` batches
them, requests joining at different steps), token for token. Float sums in a batched forward may be
ordered differently from a forward over one row; a near-tie can then pick another argmax.

    .venv/bin/python scripts/batched_greedy.py [--model DIR] [--limit 64] [--batch 8] [--max-tokens 64]
"""

import argparse

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

import mirror_mlx
from mirror_mlx.prompts import tinystories


def batched(pipe, prompts: list[list[int]], batch: int, max_tokens: int, stagger: int) -> list[list[int]]:
    """Every prompt decoded in a BatchGenerator of up to `batch` rows; a new one joins every `stagger` steps."""
    gen = BatchGenerator(pipe.model, completion_batch_size=batch, prefill_batch_size=batch,
                         stop_tokens=[[t] for t in pipe.tokenizer.eos_token_ids],
                         stream=mx.default_stream(mx.default_device()))
    out, todo, step = {}, list(enumerate(prompts)), 0
    uids: dict = {}
    while todo or uids:
        if todo and len(uids) < batch and step % stagger == 0:
            i, p = todo.pop(0)
            [uid] = gen.insert([p], max_tokens=[max_tokens])
            uids[uid], out[i] = i, []
        _, gens = gen.next()
        for g in gens:
            out[uids[g.uid]].append(g.token)
            if g.finish_reason is not None:
                del uids[g.uid]
        step += 1
    gen.close()
    return [out[i] for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="A target folder (default: the demo target).")
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    pipe = mirror_mlx.load(args.model, exit_adapter="none") if args.model else mirror_mlx.load()
    openings = [p.text for p in tinystories()][: args.limit]
    prompts = [pipe.encode(t) for t in openings]
    alone = []
    for i, p in enumerate(prompts):
        print(f"alone {i + 1}/{len(prompts)}", end="\r", flush=True)
        alone.append(pipe.generate(p, max_tokens=args.max_tokens, mode="ar").tokens)  # (end-of-sequence left out)
    together = pipe.engine.target_worker.call(batched, pipe, prompts, args.batch, args.max_tokens, 3)
    flips = []
    for i, (a, b) in enumerate(zip(alone, together)):
        b = [t for t in b if t not in pipe.tokenizer.eos_token_ids]
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            flips.append((i, at))
    tokens = sum(len(a) for a in alone)
    print(f"{len(prompts)} held-out openings × {args.max_tokens} tokens, batch up to {args.batch} (one joins every "
          f"3 steps): {len(flips)} of {len(prompts)} texts differ from their greedy text alone ({tokens} tokens)")
    for i, at in flips:
        print(f"  opening {i}: first differs at token {at}: {openings[i]!r}")
    pipe.close()


if __name__ == "__main__":
    main()
