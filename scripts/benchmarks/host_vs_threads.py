"""tok/s of mirror with the draft in its host process vs on a thread, against sd and ar, in one run.

    .venv/bin/python scripts/benchmarks/host_vs_threads.py TARGET DRAFT [MAX_TOKENS] [N_PROMPTS]

Every mode decodes the same held-out TinyStories openings greedily; tokens must agree. Prints per
mode the summed tok/s, mean accepted per forward and the hidden-draft fraction, plus the load average
(the machine may be shared: compare rows of one run). On a checkout without the draft host (main
before it) the thread row is what `mirror` was.
"""

import sys

from mlx_lm import load

from mirror_mlx.drafts.mlx_draft import MLXDraft
from mirror_mlx.pipeline import Pipeline, load_draft


def openings(n):
    from pathlib import Path

    data = Path(__file__).resolve().parents[2] / "mirror_mlx" / "data" / "tinystories_train.txt"
    paragraphs = [p for p in data.read_text().split("\n\n") if p.strip()]
    return [" ".join(p.split()[:8]) for p in paragraphs[-n:]]  # the file's last paragraphs


def run(pipe, prompts, mode, max_tokens):
    toks, secs, acc, hid, dr = [], 0.0, [], 0.0, 0.0
    for p in prompts:
        r = pipe.generate(p, max_tokens=max_tokens, mode=mode, stop=False)
        toks.append(r.tokens)
        secs += r.stats.decode_seconds
        acc.append(r.stats.mean_accepted)
        hid += r.stats.hidden_draft_seconds
        dr += r.stats.draft_seconds
    n = sum(len(t) for t in toks)
    return toks, n / secs, sum(acc) / len(acc), (hid / dr if dr else 0.0)


if __name__ == "__main__":
    target_dir, draft_dir = sys.argv[1], sys.argv[2]
    max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    print("load average before:", open("/proc/loadavg").read().split()[:3])
    target, tok = load(target_dir)
    prompts = [tok.encode(o) for o in openings(n)]
    has_host = hasattr(sys.modules["mirror_mlx.engine.loop"], "DraftHost")  # main before the draft host: threads only
    pipes = {"thread": Pipeline(target, tok, MLXDraft(load(draft_dir)[0]))}
    if has_host:
        pipes["process"] = Pipeline(target, tok, load_draft(draft_dir, tok))
    ref = None
    for name, pipe in pipes.items():
        pipe.generate(prompts[0], max_tokens=8, stop=False)  # warm-up
        for mode in (("mirror", "sd", "ar") if name == "thread" else ("mirror", "sd")):
            toks, tps, acc, hidden = run(pipe, prompts, mode, max_tokens)
            ref = ref or toks
            assert toks == ref, f"{mode} ({name}) disagrees"
            print(f"{mode:6s} draft on {name:7s}  {tps:7.1f} tok/s  {acc:4.2f} accepted/forward  hidden {100 * hidden:3.0f}%",
                  flush=True)
    for pipe in pipes.values():
        pipe.close()
    print("load average after:", open("/proc/loadavg").read().split()[:3])
