"""`mirror-mlx convert --verify`: the saved package against its MLX draft, on Linux (docs/ane.md).

The package's MIL program, re-read from disk, is evaluated op by op (mil_eval) and driven by the
Mac runtime's own host code (ane_draft/package_host.py): extend a real prompt, a few Mirror-SD
rollouts, commits, and a rollback. Every logit row the package produced (extend, rollout and stream
rows) is compared with the MLX draft's float32 logits for the same tokens (teacher forcing, so one
flipped argmax cannot cascade), within TOLERANCE (a fraction of the largest |logit| plus a floor:
fp16 is not exact, and quantized packages are compared with the unquantized draft); an argmax may
differ only where MLX's top two logits are closer than that (a near-tie, reported). A 4/8-bit MLX
draft keeps its integer weights with float32 scales: the very weights the package holds. A distilled
draft's package returns one column per kept id: they are compared with the MLX draft's kept logits
(Model.kept_logits: its full-vocabulary rows at the kept ids).
"""

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Optional, Sequence, cast

import mlx.core as mx
import numpy as np

from mlx_lm.models.cache import KVCache, make_prompt_cache
from tqdm import tqdm

from mirror_mlx.ane_draft.package_host import PackageDraft
from mirror_mlx.engine.batching import padded_batches
from mirror_mlx.engine.model_parts import flat
from mirror_mlx.ane_draft.package_format import (ConvertError, package_shapes, read_metadata,
                                                 tokenizer_sha256)
from mirror_mlx.convert.coreml import check_match, draft_sha256, model_kept_ids
from mirror_mlx.convert.mil_eval import MilRunner
from mirror_mlx.drafts.ss.model import ss_forward
from mirror_mlx.loading import load_model

if TYPE_CHECKING:
    from mirror_mlx.drafts.ss.model import Model as SSModel
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

TOLERANCE = {"none": (0.03, 0.05), "int8": (0.10, 0.05), "lut6": (0.25, 0.1), "lut4": (0.50, 0.2)}
PROMPTS = ("Once upon a time, there was a little girl named Lily. She loved to play",
           "The sun was shining and the birds were singing in the tall green trees.")


REAL_SIZE = 250_000_000  # dense parameters from which --verify runs one step per prompt by default


@dataclass
class Budget:
    """How much of the check to run: `seconds` of wall time, `rows` rollout rows compared, or the
    first `steps` steps of each prompt; `why` is what the verdict calls the cut."""

    seconds: Optional[float] = None
    rows: Optional[int] = None
    steps: Optional[int] = None
    why: str = "budget"

    @classmethod
    def parse(cls, text: str) -> "Budget":
        """--verify-budget: '300s', '5m', '2000rows', '1steps', or 'all' (every step and row, whatever
        the draft's size)."""
        if (text or "").strip() == "all":
            return cls()
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|rows|steps?)\s*", text or "")
        if not m or float(m.group(1)) <= 0 or (m.group(2) not in ("s", "m") and not float(m.group(1)).is_integer()):
            raise ConvertError(f"--verify-budget must be a time like 300s or 5m, a row count like 2000rows, steps per "
                               f"prompt like 1steps, or all (got {text!r})")
        n, unit = float(m.group(1)), m.group(2)
        if unit.startswith("step"):
            return cls(steps=int(n), why=f"budget: {int(n)} per prompt")
        return cls(rows=int(n)) if unit == "rows" else cls(seconds=n * (60 if unit == "m" else 1))

    @classmethod
    def default(cls, parameters: int) -> "Budget":
        """Everything for a small draft; from REAL_SIZE parameters, the first step of each prompt
        (both functions, every row of it, and a rollback: every code path of the package)."""
        if parameters < REAL_SIZE:
            return cls()
        return cls(steps=1, why=f"{parameters / 1e6:.3g}M parameters: the first of each prompt by default; "
                                "--verify-budget all runs every step")


def dense_parameters(model: "nn.Module") -> int:
    """The draft's weights as the package computes with them: a quantized MLX layer counted
    dequantized, a tied head once (norms and biases are left out: they cost nothing)."""
    n = 0
    for _, m in model.named_modules():
        if "weight" in m and hasattr(m, "scales"):
            n += m.scales.size * m.group_size
        elif "weight" in m and m.weight.ndim == 2:
            n += m.weight.size
    return n


@dataclass
class Parity:
    """What --verify measured."""

    quantize: str
    extend_rows: int = 0
    rollout_rows: int = 0  # rollout rows compared with the reference
    produced_rows: int = 0  # rollout rows the package produced (all of them run: they build the state)
    calls: int = 0
    steps: int = 0  # rollout steps run
    planned_steps: int = 0
    cut: str = "budget"  # why steps were left out, when they were
    max_abs: float = 0.0  # max |logit_package - logit_mlx|
    scale: float = 0.0  # max |logit_mlx|
    greedy: int = 0  # greedy tokens compared
    mismatches: int = 0  # argmax differs where MLX's top-2 margin exceeds the tolerance
    near_ties: int = 0  # argmax differs inside the tolerance
    nan_rows: int = 0  # rows where the package gave NaN or inf (never hidden inside max |dlogit|)
    margins: list[float] = field(default_factory=list, repr=False)  # MLX top-2 margins where argmax differs
    kept: Optional[np.ndarray] = field(default=None, repr=False)  # a trimmed head's ids: the package's columns

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
        of = "" if self.rollout_rows == self.produced_rows else f" (sampled, of {self.produced_rows})"
        cut = "" if self.steps == self.planned_steps else f", {self.steps} of {self.planned_steps} steps ({self.cut})"
        return (f"{verdict}{q}: {self.extend_rows} extend + {self.rollout_rows}{of} rollout rows "
                f"({self.calls} rollout calls{cut}); max |dlogit| {self.max_abs:.4f} "
                f"(tolerance {self.tolerance:.3f} = {TOLERANCE[self.quantize][0]:.0%} of logit range "
                f"{self.scale:.2f} + {TOLERANCE[self.quantize][1]}); "
                f"greedy {self.greedy - self.mismatches - self.near_ties}"
                f"/{self.greedy} identical, {self.near_ties} near-ties, {self.mismatches} mismatches")

    def add_extend(self, got: dict[int, np.ndarray], ref: np.ndarray) -> None:
        """Compare the extend rows the package produced, by position, with the reference's."""
        new = sorted(got)
        if new:
            self.add(np.stack([got[p] for p in new]), ref[new])
            self.extend_rows += len(new)

    def add(self, got: np.ndarray, ref: np.ndarray) -> None:
        """Compare logit rows (n, V) with the reference's (n, vocab), at the kept ids of a trimmed head."""
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        if self.kept is not None:
            ref = ref[:, self.kept]
        bad = ~np.isfinite(got).reshape(len(got), -1).all(-1)
        self.nan_rows += int(bad.sum())
        got = np.where(np.isfinite(got), got, np.float32(np.inf))  # max |dlogit| is then inf, not 0
        self.max_abs = max(self.max_abs, float(np.abs(got - ref).max()))
        self.scale = max(self.scale, float(np.abs(ref).max()))
        top2 = np.sort(ref, axis=-1)[:, -2:]
        margin = top2[:, 1] - top2[:, 0]
        differ = got.argmax(-1) != ref.argmax(-1)
        self.greedy += len(got)
        self.margins += [float(m) for m in margin[differ]]

    def settle(self) -> "Parity":
        """Classify argmax differences once the tolerance (which depends on the scale) is known."""
        margins = np.array(self.margins, np.float32)
        self.near_ties = int((margins <= self.tolerance).sum())
        self.mismatches = int((margins > self.tolerance).sum())
        return self


def float32_reference(model: "nn.Module") -> "nn.Module":
    """The MLX draft with float32 activations: its float parameters cast in place (a quantized
    layer keeps its integer weights; its scales and biases become float32)."""
    if any(p.dtype in (mx.float16, mx.bfloat16) for _, p in flat(model.parameters())):
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())  # now, so the half-precision weights are freed now
    return model


class Reference:
    """The float32 MLX draft after one committed context: its logits, greedy window and branch rows,
    each computed on the K/V it shares (the context's, or the context plus a prefix of the window)."""

    def __init__(self, model: "nn.Module", context: Sequence[int]):
        self.model, self.n = model, len(context)
        self.cache = make_prompt_cache(model)
        self.logits = np.array(model(mx.array([list(context)]), cache=self.cache)[0].astype(mx.float32))
        mx.eval([c.state for c in self.cache])
        # K/V of the context, and of the window after it once stems() has run
        self.kv = [(c.keys[..., : self.n, :], c.values[..., : self.n, :]) for c in self.cache]
        self.window: list[int] = []
        self.window_rows = [self.logits[-1]]  # logits after context + window[:r]

    def _caches(self, batch: int, r: int = 0) -> list:
        """Caches holding the context and the first r window tokens, `batch` times."""
        caches, end = [], self.n + r
        for k, v in self.kv:
            c = KVCache()
            c.keys, c.values = mx.repeat(k[..., :end, :], batch, axis=0), mx.repeat(v[..., :end, :], batch, axis=0)
            c.offset = end
            caches.append(c)
        return caches

    def stems(self, kappa: int, gamma: int) -> tuple[list[int], list[list[int]]]:
        """The draft's own greedy window and kappa*(gamma+1) Mirror-SD stems (row r < gamma never
        proposes window[r] again)."""
        caches, rows, window = self._caches(1), [self.logits[-1]], []
        for _ in range(gamma):
            window.append(int(rows[-1].argmax()))
            rows.append(np.array(self.model(mx.array([[window[-1]]]), cache=caches)[0, -1].astype(mx.float32)))
        end = self.n + gamma
        self.kv = [(c.keys[..., :end, :], c.values[..., :end, :]) for c in caches]
        self.window, self.window_rows = window, rows
        stems = []
        for r in range(gamma + 1):
            order = np.argsort(-rows[r])
            cands = [int(t) for t in order if r == gamma or t != window[r]][:kappa]
            stems += [window[:r] + [v] for v in cands]
        return window, stems

    def rows(self, paths: Sequence[tuple[int, ...]], batch: int = 16) -> dict[tuple[int, ...], np.ndarray]:
        """Logits (V,) after context + path for every path: the window's own rows, else one forward per
        branch leaf, right-padded, batched by the window prefix they start with (on its K/V)."""
        want = set(paths)
        out: dict[tuple[int, ...], np.ndarray] = {}
        for m in range(1, len(self.window) + 1):
            if tuple(self.window[:m]) in want:
                out[tuple(self.window[:m])] = self.window_rows[m]
        kept: list[tuple[int, ...]] = []
        covered: set[tuple[int, ...]] = set(out)
        for p in sorted(want, key=len, reverse=True):
            if p not in covered:
                kept.append(p)
                covered.update(p[:m] for m in range(1, len(p) + 1))
        def shared(p: tuple[int, ...]) -> int:  # window tokens p starts with (at least one token is fed)
            r = 0
            while r < min(len(p) - 1, len(self.window)) and p[r] == self.window[r]:
                r += 1
            return r

        kept.sort(key=lambda p: (shared(p), -len(p)))
        for i in range(0, len(kept), batch):  # a batch starts after the window prefix all its leaves share
            part = kept[i : i + batch]
            r = min(shared(p) for p in part)
            n = max(len(p) for p in part) - r
            x = mx.array([list(p[r:]) + [0] * (n - len(p) + r) for p in part], dtype=mx.int32)
            logits = self.model(x, cache=self._caches(len(part), r)).astype(mx.float32)
            for j, p in enumerate(part):
                ms = [m for m in range(r + 1, len(p) + 1) if p[:m] in want and p[:m] not in out]
                if ms:
                    got = np.array(logits[j, mx.array([m - r - 1 for m in ms])])
                    out.update((p[:m], got[t]) for t, m in enumerate(ms))
        return out


def _stream_logits(model: "SSModel", seqs: Sequence[Sequence[int]], batch: int = 16) -> list[np.ndarray]:
    """An SS draft's stream logits (streams, V) at the last position of each sequence (right
    padding is harmless: rows only see what comes before them)."""
    out = []
    for _, part, x in padded_batches(seqs, batch):
        st = np.array(ss_forward(model, x).streams.astype(mx.float32))
        out += [st[j, :, len(s) - 1] for j, s in enumerate(part)]
    return out


def _sample(paths: list[tuple[int, ...]], limit: Optional[int], rng: np.random.Generator) -> list[tuple[int, ...]]:
    """At most `limit` of the paths, whole branches at a time (a leaf and all its ancestors), in a
    seeded random order; all of them when there is no limit."""
    if limit is None or len(paths) <= limit:
        return paths
    chosen: set[tuple[int, ...]] = set()
    have = set(paths)
    for i in rng.permutation(len(paths)):
        branch = {paths[i][:m] for m in range(1, len(paths[i]) + 1)} & have
        if chosen and len(chosen | branch) > limit:
            continue
        chosen |= branch
    return [p for p in paths if p in chosen]


def _check_fits(contexts: list[list[int]], steps: int, gamma: int, positions: int) -> None:
    """Every prompt, plus `steps` windows of γ + 1, fits the package's context."""
    for context in contexts:
        need = len(context) + steps * (gamma + 1) + 1
        if need > positions:
            raise ConvertError(
                f"the verification prompt needs {need} context positions but the package has {positions}; "
                f"rebuild it with --context {max(need, 64)} or more"
            )


def verify(package: Path, draft: Path, steps: int = 3, prompts: Sequence[str] = PROMPTS,
           model: "Optional[nn.Module]" = None, tokenizer: "Optional[TokenizerWrapper]" = None, runner: Any = None,
           budget: Optional[Budget] = None, progress: bool = False) -> Parity:
    """Evaluate the saved package against the MLX draft in `draft` with `runner` (default: the MIL
    evaluator; on a Mac, ane_draft.coreml_draft.CoreMLRunner checks Core ML itself)."""
    package, draft = Path(package), Path(draft)
    meta = read_metadata(package)
    if not (draft / "config.json").is_file():
        raise ConvertError(f"{draft} is not an MLX model folder (no config.json); give --draft-model a folder")
    if model is None:
        model, tokenizer = load_model(draft)
    assert tokenizer is not None, "a model is given with its tokenizer"
    shapes = package_shapes(meta)
    kept = model_kept_ids(model)
    check_match(meta, SimpleNamespace(tokenizer_sha256=tokenizer_sha256(tokenizer), draft_sha256=draft_sha256(model),
                                      kept_ids=kept), package)
    try:  # before the float32 cast: the runner's load peaks next to the draft's bf16 weights, not float32
        runner = runner if runner is not None else MilRunner(package)
    except Exception as e:  # noqa: BLE001
        raise ConvertError(f"{package} could not be read back ({type(e).__name__}: {e}); "
                           "it is corrupt: rebuild it") from None
    model = float32_reference(model)
    budget = budget or Budget.default(dense_parameters(model))
    draft_pkg = PackageDraft(runner, meta, trace=True)
    report = Parity(meta["quantize"], planned_steps=steps * len(prompts), cut=budget.why, kept=kept)
    kappa, gamma = shapes.kappa, shapes.gamma
    per_prompt = min(steps, budget.steps or steps)
    per_step = None if budget.rows is None else max(1, budget.rows // (per_prompt * len(prompts)))
    rng, start = np.random.default_rng(0), time.monotonic()
    contexts = [list(tokenizer.encode(text)) for text in prompts]
    _check_fits(contexts, steps, gamma, shapes.context)
    bar = tqdm(total=per_prompt * len(prompts), desc=f"verify {package.name}", unit="step",
               disable=None if progress else True)  # None: shown on a terminal only
    for context in contexts:
        draft_pkg.reset()
        for step in range(per_prompt):
            if budget.seconds is not None and report.steps and time.monotonic() - start > budget.seconds:
                break
            ref = Reference(model, context)
            window, stems = ref.stems(kappa, gamma)
            draft_pkg.trace.extend.clear()
            draft_pkg.trace.rows.clear()
            result = draft_pkg.rollout(context, stems, gamma)
            report.add_extend(draft_pkg.trace.extend, ref.logits)
            rows = {tuple(path): (main, streams) for path, main, streams in draft_pkg.trace.rows}
            chosen = _sample(list(rows), per_step, rng)
            refs = ref.rows(chosen)
            for path in chosen:
                report.add(rows[path][0][None], refs[path][None])
            if shapes.streams:
                ss_model = cast("SSModel", model)  # (a package with streams: an SS draft's)
                for p, want in zip(chosen, _stream_logits(ss_model, [context + list(p) for p in chosen])):
                    streams = rows[p][1]
                    assert streams is not None, "a package with streams traces their logits"
                    report.add(streams, want)
            report.rollout_rows += len(chosen)
            report.produced_rows += len(draft_pkg.trace.rows)
            report.calls += result.forwards
            report.steps += 1
            a = step % (gamma + 1)  # accept a draft tokens, then the first candidate of row a
            context = context + stems[a * kappa]
            if step == per_prompt - 1:  # roll back: the cache must forget what was trimmed
                context = context[:-3] + [(context[-3] + 1) % draft_pkg.vocab_size]
                draft_pkg.trace.extend.clear()
                draft_pkg.sync(context)
                report.add_extend(draft_pkg.trace.extend, Reference(model, context).logits)
            del ref, refs, rows
            mx.clear_cache()  # MLX keeps freed buffers for reuse: at 0.6B they pile up to GBs
            bar.update(1)
            bar.set_postfix_str(f"max |dlogit| {report.max_abs:.3f}")
    bar.close()
    return report.settle()
