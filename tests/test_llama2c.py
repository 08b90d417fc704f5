"""llama2.c import: mlx_lm.load reads the folder and generates the reference text."""

import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx_lm import load

from mirror_mlx.cli import main
from mirror_mlx.convert.llama2c import ImportError_, import_llama2c, read_checkpoint
from tests.models import DRAFT_PATH, TARGET_PATH
from tests.support import reference_greedy

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "models"
# llama2.c's test_all.py: stories260K, greedy, 200 steps from BOS.
LLAMA2C_EXPECTED = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball. She wanted to play with it, but it was too high.\nLily's mom "
    "said, \"Lily, let's go to the park.\" Lily was sad and didn't know what to do. She said, \"I want "
    "to play with your ball, but I can't find it.\"\nLily was sad and didn't know what to do. She "
    "said, \"I'm sorry, Lily. I didn't know what to do.\"\nLily didn't want to help her mom, so she"
)


def test_demo_target_continues_once_upon_a_time_like_llama2c():
    model, tokenizer = load(str(TARGET_PATH))
    prompt = tokenizer.encode("Once upon a time")
    assert prompt == [1, 403, 407, 261, 378]
    text = tokenizer.decode(reference_greedy(model, prompt, 40))
    assert text == ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball."


def test_demo_target_from_bos_reproduces_llama2c_test_output():
    model, tokenizer = load(str(TARGET_PATH))
    assert tokenizer.decode(reference_greedy(model, [1], 200)) == LLAMA2C_EXPECTED


def test_demo_draft_loads_and_is_coherent():
    model, tokenizer = load(str(DRAFT_PATH))
    text = tokenizer.decode(reference_greedy(model, tokenizer.encode("Once upon a time"), 20))
    assert text.startswith(", there was a little girl named Lily.")


needs_shared = pytest.mark.skipif(not SHARED.exists(), reason="../shared/data/models is not beside this clone")


@needs_shared
def test_cli_import_writes_a_folder_mlx_lm_loads(tmp_path):
    out = tmp_path / "s260"
    result = CliRunner().invoke(main, ["import-llama2c", str(SHARED / "stories260K/stories260K.bin"),
                                       "--tokenizer", str(SHARED / "stories260K/tok512.model"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer.model"} <= {p.name for p in out.iterdir()}
    model, _ = load(str(out))
    ref, _ = load(str(TARGET_PATH))
    tokens = mx.array([[1, 403, 407, 261, 378]])
    assert mx.array_equal(model(tokens), ref(tokens))


def test_truncated_checkpoint_is_refused_with_its_sizes(tmp_path):
    bad = tmp_path / "bad.bin"
    src = SHARED / "stories260K/stories260K.bin"
    if src.exists():
        bad.write_bytes(src.read_bytes()[:5000])
    else:  # a header that promises stories260K's shape and no weights
        import struct
        bad.write_bytes(struct.pack("<7i", 64, 172, 5, 8, 4, 512, 512) + b"\0" * 5000)
    with pytest.raises(ImportError_, match="truncated"):
        read_checkpoint(bad)
    result = CliRunner().invoke(main, ["import-llama2c", str(bad), "--tokenizer", "x.model", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "truncated" in result.output and "Traceback" not in result.output


def test_missing_checkpoint_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["import-llama2c", str(tmp_path / "nope.bin"), "--tokenizer", "t.model",
                                       "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "checkpoint not found" in result.output


@needs_shared
def test_tokenizer_with_another_vocabulary_is_refused(tmp_path):
    import sentencepiece as spm

    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat\n" * 200 + "a dog ran in the park\n" * 200)
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "t"), vocab_size=40,
                                   model_type="bpe", minloglevel=2)
    with pytest.raises(ImportError_, match="has 40 tokens but the checkpoint's vocabulary has 512"):
        import_llama2c(SHARED / "stories260K/stories260K.bin", tmp_path / "t.model", tmp_path / "o")
