"""Mirror-mode greedy decoding with each draft on TinyStories openings: acceptance, J, η̄, lossless.

    .venv/bin/python scripts/measure_ss.py --n 50 --max-tokens 128 --gamma 7 [--drafts llama2xs,ss]

Per draft: mean accepted tokens per target forward (correction counted), J = draft forwards per
window (every forward a rollout runs, syncing included; for a branch rollout the slowest of the
κ·(γ+1) branches decides it), J over branch rollouts and over single-window rollouts (the first
window and fallbacks) apart, the mean per-branch forwards for SS drafts, η̄ = γ/J, and whether
every output equals the target's own greedy text (ar mode).
"""

import argparse
import json
import time

import mirror_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)
from mlx_lm import load as mlx_load

from mirror_mlx.drafts.ss.draft import SSDraft
from mirror_mlx.demo import DRAFT, SS_DRAFT, TARGET
from mirror_mlx.drafts.mlx_draft import MLXDraft
from mirror_mlx.engine.stats import Stats
from mirror_mlx.pipeline import Pipeline
from mirror_mlx.prompts import load_prompts



class Recorder:
    """Passes rollouts through and keeps the per-branch forwards of SS drafts."""

    def __init__(self, draft):
        self.draft, self.vocab_size, self.branch_forwards = draft, draft.vocab_size, []
        self.forwards = {"branch": [], "single": []}  # J of each rollout, by kind

    def reset(self) -> None:
        self.draft.reset()

    def sync(self, context) -> None:  # the engine prefills the draft beside the target with it
        self.draft.sync(context)

    def rollout(self, context, stems, gamma):
        out = self.draft.rollout(context, stems, gamma)
        self.forwards["branch" if len(stems) > 1 else "single"].append(out.forwards)
        if isinstance(self.draft, SSDraft):
            self.branch_forwards += self.draft.stats.branch_forwards
        return out


def mean(xs: list) -> float:
    return round(sum(xs) / len(xs), 3) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--kappa", type=int, default=8)
    ap.add_argument("--ss-draft", default=str(SS_DRAFT))
    ap.add_argument("--drafts", default="llama2xs,ss,ss+trust_streams", help="comma-separated subset")
    args = ap.parse_args()
    target, tok = mlx_load(str(TARGET))
    plain_model, _ = mlx_load(str(DRAFT))
    ss = SSDraft.from_path(args.ss_draft, trust_streams=False)
    drafts = {"llama2xs": MLXDraft(plain_model), "ss": ss,
              "ss+trust_streams": SSDraft(ss.model, trust_streams=True)}
    unknown = set(args.drafts.split(",")) - set(drafts)
    if unknown:
        ap.error(f"unknown --drafts {', '.join(sorted(unknown))}: choose from {', '.join(drafts)}")
    drafts = {k: drafts[k] for k in args.drafts.split(",")}
    prompts = [p.text for p in load_prompts("tinystories", args.n)]
    ar = Pipeline(target, tok, None)
    reference = [ar.generate(p, max_tokens=args.max_tokens, mode="ar").tokens for p in prompts]
    results = {}
    for name, draft in drafts.items():
        rec = Recorder(draft)
        pipe = Pipeline(target, tok, rec)
        tot, same, t0 = Stats(), 0, time.time()
        for p, ref in zip(prompts, reference):
            r = pipe.generate(p, max_tokens=args.max_tokens, gamma=args.gamma, kappa=args.kappa, mode="mirror")
            tot += r.stats
            same += r.tokens == ref
        pipe.close()
        bf = rec.branch_forwards
        results[name] = {
            "mean_accepted": round(tot.mean_accepted, 3), "J": round(tot.draft_forwards_per_window, 3),
            "eta": round(tot.eta, 3),
            "J_branch_rollouts": mean(rec.forwards["branch"]), "J_single_rollouts": mean(rec.forwards["single"]),
            "branch_J": mean(bf),
            "lossless": f"{same}/{len(prompts)}", "seconds": round(time.time() - t0, 1)}
        print(name, json.dumps(results[name]), flush=True)
    ar.close()


if __name__ == "__main__":
    main()
