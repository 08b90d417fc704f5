"""Progress bars tell the truth: tune's bars are per phase, each with its real total (or none where the
rounds are not known ahead) and never past it; train-exit's bars name the set they run over; widen shows
a bar over its tensors instead of seconds of silence."""

import sys

import pytest
import tqdm
from click.testing import CliRunner
from mlx_lm import load as mlx_load

from mirror_mlx.train import exit_adapter
from mirror_mlx.cli import main
from mirror_mlx.pipeline import load
from mirror_mlx.tune import calibrate
from tests.models import TARGET_PATH


@pytest.fixture
def bars(monkeypatch):
    """Every tqdm bar made while the test runs: tqdm.tqdm, and each loaded module's own `tqdm` name for it."""
    made = []

    class Recorded(tqdm.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.label = kwargs.get("desc") or ""  # (a disabled bar keeps no desc)
            made.append(self)

    original = tqdm.tqdm
    monkeypatch.setattr(tqdm, "tqdm", Recorded)
    for name, module in list(sys.modules.items()):
        if name.startswith("mirror_mlx") and getattr(module, "tqdm", None) is original:
            monkeypatch.setattr(module, "tqdm", Recorded)
    return made


def test_tune_has_a_bar_per_phase_that_ends_at_its_total(bars):
    cfg = calibrate.TuneConfig(prompts=2, max_tokens=8, kappas=(1, 2), gammas=(1, 2), reps=1, confirm=2,
                               confirm_prompts=1, min_seconds=0, min_timed_s=0, exact_top=2, progress=True)
    pipe = load()
    try:
        calibrate.calibrate(pipe, cfg)
    finally:
        pipe.close()
    tune = [b for b in bars if b.label.startswith("tune")]
    names = [b.label for b in tune]
    assert [n for n in names if "‖" not in n] == ["tune: traces", "tune: timings", "tune: probes", "tune: confirm"]
    assert "tune: suffix ‖ rollout" in names
    for b in tune:
        assert b.total is None or b.n == b.total, (b.label, b.n, b.total)  # complete, never past the total
        assert b.total is not None or b.n > 0 or b.label.endswith("rollout")
    timings = next(b for b in tune if b.label == "tune: timings")
    # verify widths {1, 2, 3}, host windows γ ∈ {1, 2}, rollouts κ×γ, mirror's prepares γ ∈ {1, 2}, split forwards
    # ℓe×γ (the demo adapter's one ℓe), in-process (sd's) windows γ ∈ {1, 2}
    assert timings.total == 3 + 2 + 4 + 2 + 2 + 2


def test_train_exit_s_bars_name_the_training_and_the_held_out_text(bars):
    model, tokenizer = mlx_load(str(TARGET_PATH))
    text = "\n\n".join(f"Tom had a red ball number {i}. He liked it." for i in range(24))
    exit_adapter.train_exit_adapter(model, tokenizer, 2, text, steps=2, max_tokens=4, held_out_openings=2, progress=True)
    greedy = sorted(b.label for b in bars if b.label.startswith("greedy text"))
    assert greedy == ["greedy text (held-out)", "greedy text (train)"]
    assert sorted(b.label for b in bars if b.label.startswith("states")) == ["states L2 (held-out)", "states L2 (train)"]


def test_widen_shows_a_bar_over_its_tensors(tmp_path, bars):
    r = CliRunner().invoke(main, ["widen", "--model", str(TARGET_PATH), "--out", str(tmp_path / "wide"), "--hidden",
                                  "128", "--heads", "16", "--kv-heads", "16", "--intermediate", "344", "--layers", "6"])
    assert r.exit_code == 0, r.output
    bar = next(b for b in bars if b.label.startswith("widen"))
    assert bar.total == bar.n > 0
    assert "tensor" in r.stderr and r.stdout.strip() == f"wrote {tmp_path / 'wide'}"
