"""The Core ML draft on a Mac: the package on Core ML itself (CPU_AND_NE), in process and in its
own process. Runs only on macOS 15+ with coremltools' native runtime; skipped elsewhere."""

import sys

import mlx.core as mx
import pytest
from mlx_lm.utils import load

from mirror_mlx.ane_draft.coreml_draft import CoreMLRunner, coreml_available, coreml_recipe
from mirror_mlx.drafts.host import DraftHost
from mirror_mlx.convert.coreml import convert
from mirror_mlx.convert.parity import verify
from mirror_mlx.demo import DRAFT as DEMO_DRAFT

pytestmark = pytest.mark.skipif(
    not coreml_available(),
    reason=f"Core ML predictions need macOS 15+ with coremltools' native runtime (this is {sys.platform})",
)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    out = tmp_path_factory.mktemp("coreml-mac") / "llama2xs.mlpackage"
    return convert(DEMO_DRAFT, out, context=128, kappa=2, gamma=3, chunk=8, progress=False)


def test_parity_on_core_ml_itself(pkg):
    report = verify(pkg, DEMO_DRAFT, runner=CoreMLRunner(pkg))
    print(report.line())
    assert report.ok, report.line()


def test_coreml_draft_process_rolls_out_the_greedy_windows(pkg):
    model, tok = load(str(DEMO_DRAFT))
    ctx = tok.encode("Once upon a time, there was a little girl")
    stems = [[5], [6, 7], [9, 10, 11]]
    host = DraftHost(coreml_recipe(pkg, tok))
    r = host.rollout(ctx, stems, 3)
    host.close()
    for stem, window in zip(stems, r.windows):
        seq, want = ctx + stem, []
        for _ in range(3):
            want.append(int(mx.argmax(model(mx.array([seq]))[0, -1]).item()))
            seq.append(want[-1])
        assert window == want
