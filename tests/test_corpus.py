"""One corpus split: the benchmark's openings begin no training text of the shipped SS draft or exit adapter.

The honesty checks rebuild each artefact's training text from what the artefact itself records
(demo/ss_draft/training.json, the exit adapter's safetensors metadata) with a plain parse of the
corpus file, so they do not trust the split function they check.
"""

import json

import mlx.core as mx

from mirror_mlx.corpus import CORPUS, HELD_OUT_PARAGRAPHS, opening, paragraphs, split
from mirror_mlx.prompts import load_prompts
from tests.models import DEMO


def _raw_paragraphs() -> list[str]:
    return [" ".join(q.split()) for q in CORPUS.read_text(encoding="utf-8").split("\n\n") if q.strip()]


def _disjoint(bench: list[str], training_paragraphs: list[str]) -> list[str]:
    """Bench openings that a training paragraph begins with, or that begin with a training paragraph's opening."""
    starts = {opening(p) for p in training_paragraphs}
    return [b for b in bench
            if any(p.startswith(b) for p in training_paragraphs) or any(b.startswith(s) for s in starts)]


def test_split_trains_on_the_rest_and_holds_out_openings_of_the_first_paragraphs():
    text = ("Once upon a time, there was a cat. It sat.\n\nTom ran to the big red park. Fun.\n\n"
            "The sun was hot and bright today. Yes.\n\nOnce upon a time, there was a cat. Later.\n\n"
            "Tom ran to the big red park. Then he went home.")
    s = split(text, held_out=3)
    assert s.train == paragraphs(text)[3:]
    # the cat and Tom openings begin training paragraphs too, so they are not held out
    assert s.held_out == ["The sun was hot and bright today."]
    assert s.train_openings == ["Once upon a time, there was a cat.", "Tom ran to the big red park."]


def test_benchmark_openings_are_the_held_out_side_in_file_order():
    bench = [p.text for p in load_prompts("tinystories")]
    held = split(CORPUS.read_text(encoding="utf-8")).held_out
    assert bench == held and len(bench) > 150
    firsts = _raw_paragraphs()[:HELD_OUT_PARAGRAPHS]
    assert all(any(q.startswith(b) for q in firsts) for b in bench)


def test_the_shipped_ss_draft_never_trained_on_a_benchmark_opening():
    cfg = json.loads((DEMO / "ss_draft" / "training.json").read_text())["config"]
    assert cfg["corpus"].endswith(CORPUS.name)
    training = _raw_paragraphs()[cfg["holdout"]:]  # train/ss_draft.py trains on their prefixes (and the target's text)
    bench = [p.text for p in load_prompts("tinystories")]
    assert len(training) > 3000 and _disjoint(bench, training) == []


def test_the_shipped_exit_adapter_never_trained_on_a_benchmark_opening():
    _, md = mx.load(str(DEMO / "stories260K_exit2.safetensors"), return_metadata=True)
    assert md["corpus"] == CORPUS.name
    training = _raw_paragraphs()[int(md["held_out_paragraphs"]):]  # it trains on these paragraphs' openings
    bench = [p.text for p in load_prompts("tinystories")]
    assert len(training) > 3000 and _disjoint(bench, training) == []


def test_tune_calibrates_on_openings_no_benchmark_run_uses():
    """`tune` takes from the last 40 held-out openings; `make bench` the first 10 (headline) and the next 2 (sweep)."""
    from mirror_mlx.tune.calibrate import TuneConfig
    from mirror_mlx.tune.traces import calibration_prompts

    class Ids:  # calibration_prompts only encodes: keep the text
        encode = staticmethod(lambda text: text)

    bench = [p.text for p in load_prompts("tinystories")][:12]
    calibration = calibration_prompts(Ids(), TuneConfig().prompts)
    assert len(calibration) == TuneConfig().prompts and not set(calibration) & set(bench)
