"""`mirror-mlx convert --verify`: the saved package against its MLX draft, on Linux.

The package's MIL program is re-read from disk and evaluated op by op (mil_eval), driven by the
very host code the Mac runtime uses (ane_draft/package_host.py): extend a real prompt, then a few
Mirror-SD-shaped rollouts (kappa*(gamma+1) stems: the draft's own window and top-kappa candidates
at every row), committing tokens and finally rolling back. Every logit row the package produced
(extend rows, every rollout row, and an SS draft's stream rows) is compared with the MLX draft's
float32 logits for the same tokens (teacher forcing, so one flipped argmax cannot cascade), and
every row's argmax with the MLX argmax.

Tolerances (max |logit difference| allowed, as a fraction of the largest |logit| seen plus a
floor): fp16 packages 3 % + 0.05; int8 10 % + 0.05; lut6 25 % + 0.1; lut4 50 % + 0.2. fp16 is not
exact: the demo draft's residual stream reaches ~600, where fp16's spacing is 0.5, and we measured
up to 1.7 % of the logit range against float32 (0.2 % with float32 activations and fp16 weights, so
the graph itself is right). Argmaxes must agree except where the MLX draft's top two logits are
closer than the tolerance (a near-tie, counted and reported). Quantized packages are compared with
the unquantized draft, so their bounds are loose by design; the numbers are reported either way.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from mirror_mlx.ane_draft.package_host import PackageDraft
from mirror_mlx.batching import padded_batches
from mirror_mlx.convert.coreml import (ConvertError, check_match, package_shapes, read_metadata,
                            spec_from_model, tokenizer_sha256)
from mirror_mlx.convert.mil_eval import MilRunner
from mirror_mlx.loading import load_model

TOLERANCE = {"none": (0.03, 0.05), "int8": (0.10, 0.05), "lut6": (0.25, 0.1), "lut4": (0.50, 0.2)}
PROMPTS = ("Once upon a time, there was a little girl named Lily. She loved to play",
           "The sun was shining and the birds were singing in the tall green trees.")


@dataclass
class Parity:
    """What --verify measured."""

    quantize: str
    extend_rows: int = 0
    rollout_rows: int = 0
    calls: int = 0
    max_abs: float = 0.0  # max |logit_package - logit_mlx|
    scale: float = 0.0  # max |logit_mlx|
    greedy: int = 0  # greedy tokens compared
    mismatches: int = 0  # argmax differs where MLX's top-2 margin exceeds the tolerance
    near_ties: int = 0  # argmax differs inside the tolerance
    nan_rows: int = 0  # rows where the package gave NaN or inf (never hidden inside max |dlogit|)
    margins: list[float] = field(default_factory=list, repr=False)  # MLX top-2 margins where argmax differs

    @property
    def tolerance(self) -> float:
        rel, floor = TOLERANCE[self.quantize]
        return rel * self.scale + floor

    @property
    def ok(self) -> bool:
        return (self.max_abs <= self.tolerance and self.mismatches == 0 and self.greedy > 0
                and self.nan_rows == 0)

    def line(self) -> str:
        verdict = "parity OK" if self.ok else "parity MISMATCH"
        if self.nan_rows:
            verdict += f" (NaN or inf logits in {self.nan_rows} rows)"
        q = "" if self.quantize == "none" else f" [{self.quantize}]"
        return (f"{verdict}{q}: {self.extend_rows} extend + {self.rollout_rows} rollout rows "
                f"({self.calls} rollout calls); max |dlogit| {self.max_abs:.4f} "
                f"(tolerance {self.tolerance:.3f} = {TOLERANCE[self.quantize][0]:.0%} of logit range "
                f"{self.scale:.2f} + {TOLERANCE[self.quantize][1]}); greedy {self.greedy - self.mismatches - self.near_ties}"
                f"/{self.greedy} identical, {self.near_ties} near-ties, {self.mismatches} mismatches")

    def add(self, got: np.ndarray, ref: np.ndarray, chosen: Optional[np.ndarray] = None) -> None:
        """Compare logit rows (n, V); `chosen` are the tokens the package picked (default argmax)."""
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        bad = ~np.isfinite(got).reshape(len(got), -1).all(-1)
        self.nan_rows += int(bad.sum())
        got = np.where(np.isfinite(got), got, np.float32(np.inf))  # max |dlogit| is then inf, not 0
        self.max_abs = max(self.max_abs, float(np.abs(got - ref).max()))
        self.scale = max(self.scale, float(np.abs(ref).max()))
        chosen = got.argmax(-1) if chosen is None else np.asarray(chosen)
        top2 = np.sort(ref, axis=-1)[:, -2:]
        margin = top2[:, 1] - top2[:, 0]
        differ = chosen != ref.argmax(-1)
        self.greedy += len(chosen)
        self.margins += [float(m) for m in margin[differ]]

    def settle(self) -> "Parity":
        """Classify argmax differences once the tolerance (which depends on the scale) is known."""
        margins = np.array(self.margins, np.float32)
        self.near_ties = int((margins <= self.tolerance).sum())
        self.mismatches = int((margins > self.tolerance).sum())
        return self


def _mlx_logits(model: Any, seqs: Sequence[Sequence[int]], last: Sequence[int], batch: int = 16) -> list[np.ndarray]:
    """float32 logits of the last `last[i]` positions of each sequence (right-padded batches)."""
    import mlx.core as mx

    out = []
    for i, part, x in padded_batches(seqs, batch):
        logits = model(x).astype(mx.float32)
        for j, s in enumerate(part):
            k = last[i + j]
            out.append(np.array(logits[j, len(s) - k : len(s)]))
    return out


def _row_logits(model: Any, seqs: Sequence[Sequence[int]], streams: int,
                batch: int = 16) -> list[tuple[np.ndarray, Optional[np.ndarray]]]:
    """Main logits (V,) at the last position of each sequence, and an SS draft's stream logits
    (streams, V) there; right padding is harmless (rows only see what comes before them)."""
    import mlx.core as mx

    if not streams:
        return [(m[0], None) for m in _mlx_logits(model, seqs, [1] * len(seqs), batch)]
    from mirror_mlx.ane_draft.ss_model import ss_forward

    out = []
    for _, part, x in padded_batches(seqs, batch):
        res = ss_forward(model, x)
        main, st = np.array(res.main.astype(mx.float32)), np.array(res.streams.astype(mx.float32))
        out += [(main[j, len(s) - 1], st[j, :, len(s) - 1]) for j, s in enumerate(part)]
    return out


def _stems(model: Any, context: list[int], kappa: int, gamma: int) -> tuple[list[int], list[list[int]]]:
    """The draft's own greedy window after `context` and kappa*(gamma+1) Mirror-SD stems."""
    import mlx.core as mx

    window: list[int] = []
    for _ in range(gamma):
        window.append(int(mx.argmax(model(mx.array([context + window]))[0, -1]).item()))
    rows = np.array(model(mx.array([context + window]))[0, len(context) - 1 :].astype(mx.float32))
    stems = []
    for r in range(gamma + 1):
        order = np.argsort(-rows[r])
        cands = [int(t) for t in order if r == gamma or t != window[r]][:kappa]
        stems += [window[:r] + [v] for v in cands]
    return window, stems


def verify(package: Path, draft: Path, steps: int = 3, prompts: Sequence[str] = PROMPTS,
           model: Any = None, tokenizer: Any = None, runner: Any = None) -> Parity:
    """Evaluate the saved package against the MLX draft in `draft`; see the module docstring.

    `runner` defaults to the MIL evaluator; on a Mac, ane_draft.coreml_draft.CoreMLRunner runs the
    same check on Core ML itself."""
    package, draft = Path(package), Path(draft)
    meta = read_metadata(package)
    if not (draft / "config.json").is_file():
        raise ConvertError(f"{draft} is not an MLX model folder (no config.json); give --draft-model a folder")
    config = json.loads((draft / "config.json").read_text())
    if model is None:
        model, tokenizer = load_model(draft)
    shapes = package_shapes(meta)
    spec = spec_from_model(model, config, tokenizer_sha256(tokenizer), shapes.slots)
    check_match(meta, spec, package)
    try:
        runner = runner if runner is not None else MilRunner(package)
    except Exception as e:  # noqa: BLE001
        raise ConvertError(f"{package} could not be read back ({type(e).__name__}: {e}); it is corrupt: rebuild it") from None
    draft_pkg = PackageDraft(runner, meta, trace=True)
    report = Parity(meta["quantize"])
    kappa, gamma = shapes.kappa, shapes.gamma
    for text in prompts:
        context = list(tokenizer.encode(text))
        need = len(context) + steps * (gamma + 1) + 1
        if need > shapes.context:
            raise ConvertError(
                f"the verification prompt needs {need} context positions but the package has {shapes.context}; "
                f"rebuild it with --context {max(need, 64)} or more"
            )
        draft_pkg.reset()
        for step in range(steps):
            window, stems = _stems(model, context, kappa, gamma)
            draft_pkg.trace.extend.clear()
            draft_pkg.trace.rows.clear()
            result = draft_pkg.rollout(context, stems, gamma)
            new = sorted(draft_pkg.trace.extend)
            if new:
                ref = _mlx_logits(model, [context[: new[-1] + 1]], [len(new)])[0]
                report.add(np.stack([draft_pkg.trace.extend[p] for p in new]), ref)
                report.extend_rows += len(new)
            rows = draft_pkg.trace.rows
            refs = _row_logits(model, [context + list(path) for path, _, _ in rows], shapes.streams)
            for (_, main, streams), (ref_main, ref_streams) in zip(rows, refs):
                report.add(main[None], ref_main[None])
                if streams is not None:
                    report.add(streams, ref_streams)
            report.rollout_rows += len(rows)
            report.calls += result.forwards
            a = step % (gamma + 1)  # accept a draft tokens, then the first candidate of row a
            context = context + stems[a * kappa]
            if step == steps - 1:  # roll back: the cache must forget what was trimmed
                context = context[:-3] + [(context[-3] + 1) % draft_pkg.vocab_size]
                draft_pkg.trace.extend.clear()
                draft_pkg.sync(context)
                new = sorted(draft_pkg.trace.extend)
                ref = _mlx_logits(model, [context], [len(context) - new[0]])[0]
                report.add(np.stack([draft_pkg.trace.extend[p] for p in new]), ref)
                report.extend_rows += len(new)
    return report.settle()
