"""`mirror-mlx convert`: build an ANE draft package, or --verify a saved one against its MLX draft."""

import sys
import tempfile
from pathlib import Path
from typing import Optional

import click

from mirror_mlx.blas import keep_freed_memory, single_threaded
from mirror_mlx.convert.coreml import ConvertError, QUANTIZE, convert
from mirror_mlx.convert.parity import Budget, verify
from mirror_mlx.options import PAPER_KNOBS


def check_writable(out: Path) -> None:
    """Fail before the (long) build when the package cannot be written where --out says."""
    parent = out.expanduser().absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise ConvertError(f"cannot write --out {out}: {parent} is not a writable folder ({e.strerror}): "
                           "choose an --out in a folder you can write to") from None


@click.command("convert")
@click.option("--draft-model", required=True, type=click.Path(path_type=Path),
              help="The MLX draft model folder (mlx-lm format, same tokenizer as the target).")
@click.option("--out", type=click.Path(path_type=Path), help="Output package, e.g. draft.mlpackage.")
@click.option("--verify", "verify_pkg", type=click.Path(path_type=Path),
              help="Instead of building: evaluate this saved package on this machine and compare it "
                   "with --draft-model (one-line verdict; exit status 1 on a mismatch).")
@click.option("--verify-budget", "budget", default=None, metavar="300s|5m|2000rows|1steps|all",
              help="Bound --verify: wall time (steps not started in time are skipped), rollout rows "
                   "compared (a seeded sample of whole branches), steps per prompt, or all; the verdict "
                   "says what was compared. Default: everything below 250M parameters, the first step "
                   "of each prompt above (every function and row of it, and a rollback).")
@click.option("--context", default=512, show_default=True, type=int,
              help="Committed tokens the draft's KV cache holds (prompt + generated).")
@click.option("--kappa", default=PAPER_KNOBS["kappa"], show_default=True, type=int,
              help="Early-exit candidates per row (κ).")
@click.option("--gamma", default=PAPER_KNOBS["gamma"], show_default=True, type=int, help="Window length (γ).")
@click.option("--chunk", default=16, show_default=True, type=int, help="Tokens per extend call.")
@click.option("--quantize", type=click.Choice(QUANTIZE), default="none", show_default=True,
              help="Weight compression of the linear layers (the embedding stays fp16).")
def convert_cmd(draft_model: Path, out: Optional[Path], verify_pkg: Optional[Path], budget: Optional[str],
                context: int, kappa: int, gamma: int, chunk: int, quantize: str) -> None:
    """Build DRAFT.mlpackage for the Neural Engine from an MLX draft, or --verify one (works on Linux)."""
    try:
        if verify_pkg is not None:
            single_threaded()
            keep_freed_memory()

            report = verify(verify_pkg, draft_model, budget=Budget.parse(budget) if budget else None,
                            progress=True)
            click.echo(report.line())
            sys.exit(0 if report.ok else 1)
        if budget is not None:
            raise click.UsageError("--verify-budget bounds --verify PACKAGE; give it with --verify")
        if out is None:
            raise click.UsageError("give --out DRAFT.mlpackage to build a package (or --verify PACKAGE to check one)")

        check_writable(out)
        convert(draft_model, out, context=context, kappa=kappa, gamma=gamma, chunk=chunk, quantize=quantize)
        click.echo(f"wrote {out} (check it with: mirror-mlx convert --verify {out} --draft-model {draft_model})")
    except ConvertError as e:
        raise click.UsageError(str(e)) from None
