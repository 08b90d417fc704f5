"""GGUF import: a tiny llama written the way llama.cpp lays it out (mlx-lm's own q/k permutation)
comes back with the same logits; files the import cannot take are refused with one sentence."""

import json
import struct

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm import load

from mirror_mlx.cli import main
from mirror_mlx.convert.gguf import GGUFError, import_gguf
from tests.support import assert_lossless, reference_greedy
from tests.gguf_files import SPECIALS, TEMPLATE, write_quantized_gguf, write_tiny_gguf

IDS = mx.array([[1, 5, 9, 30, 96, 2, 40]])


@pytest.mark.parametrize("family,dtype", [("llama_tied", mx.float32), ("llama_untied", mx.float16)])
def test_a_tiny_llama_comes_back_with_its_logits(tmp_path, family, dtype):
    model = write_tiny_gguf(tmp_path / "m.gguf", family, dtype)
    if dtype != mx.float32:  # the reference: the same weights as the file stores them
        model.update(tree_unflatten([(k, v.astype(dtype).astype(mx.float32))
                                              for k, v in tree_flatten(model.parameters())]))
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype=mx.float32)
    imported, tokenizer = load(str(out))
    assert mx.array_equal(imported(IDS), model(IDS))
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] == (family == "llama_tied")
    assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == (1, 2, 97)
    assert tokenizer.eos_token_ids == {2} and tokenizer.chat_template == TEMPLATE
    for s in SPECIALS:
        assert tokenizer.encode(s) == [SPECIALS.index(s)]
    assert tokenizer.encode("ab a") == [95, 96] and tokenizer.decode([95, 96]) == "ab a"


def test_the_cli_writes_a_folder_mirror_mlx_loads(tmp_path):
    import mirror_mlx

    model = write_tiny_gguf(tmp_path / "m.gguf")
    result = CliRunner().invoke(main, ["import-gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0 and result.output.startswith(f"wrote {tmp_path / 'out'} ("), result.output
    pipe = mirror_mlx.load(str(tmp_path / "out"))  # (with a draft: test_real_model.py)
    try:
        out = pipe.generate([1, 5, 9], max_tokens=8, mode="ar", stop=False)
    finally:
        pipe.close()
    assert_lossless(out.tokens, reference_greedy(model, [1, 5, 9], 8))
    assert out.stats.draft_failure is None


def corrupt(path, kind):
    """Rewrite the tiny file at `path` so that it shows one problem."""
    raw = bytearray(path.read_bytes())
    if kind == "truncated":
        path.write_bytes(raw[: len(raw) - 1000])
    elif kind == "not gguf":
        path.write_bytes(b"PK\x03\x04" + raw[4:])
    elif kind == "q4_k":  # the first tensor's type field: after its name, n_dims and dims
        at = raw.index(b"output_norm.weight") + len("output_norm.weight")
        n_dims = struct.unpack_from("<I", raw, at)[0]
        struct.pack_into("<I", raw, at + 4 + 8 * n_dims, 12)
        path.write_bytes(raw)


REFUSALS = {  # problem -> (how to make it, what the sentence says)
    "missing": (None, "does not exist: give the path of a .gguf file"),
    "truncated": ("truncated", "is truncated: tensor"),
    "not gguf": ("not gguf", "is not a GGUF file"),
    "q4_k": ("q4_k", "is Q4_K, which this import does not read"),
    "qwen2": ({"general.architecture": "qwen2"}, "holds a 'qwen2' model; this import reads the llama architecture only"),
    "no layers": ({"llama.block_count": None}, "lacks the metadata key llama.block_count"),
    "sentencepiece": ({"tokenizer.ggml.model": "llama"}, "has a 'llama' tokenizer"),
    "pre": ({"tokenizer.ggml.pre": "qwen2"}, "pre-tokenizer 'qwen2' is not one this import rebuilds"),
}


@pytest.mark.parametrize("problem", list(REFUSALS))
def test_a_file_it_cannot_take_is_refused_in_one_line(tmp_path, problem):
    how, sentence = REFUSALS[problem]
    path = tmp_path / "m.gguf"
    if how is not None:
        write_tiny_gguf(path, **(how if isinstance(how, dict) else {}))
        if isinstance(how, str):
            corrupt(path, how)
    with pytest.raises(GGUFError, match=sentence.replace("(", r"\(")):
        import_gguf(path, tmp_path / "out")
    result = CliRunner().invoke(main, ["import-gguf", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and sentence in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not (tmp_path / "out" / "config.json").exists()


def test_q4_0_q4_1_and_q8_0_blocks_dequantize_to_their_values(tmp_path):
    """Blocks written by hand in llama.cpp's layouts (tests/gguf_files.py), read by MLX and dequantized
    here: each weight is its block's decoded value (MLX's float16 scales: to a float16 step)."""
    from mirror_mlx.convert.gguf import hf_name, mlx_weights, read_header

    rng = np.random.default_rng(0)
    tensors = {"blk.0.attn_v.weight": ("Q4_0", rng.normal(size=(8, 64))),
               "blk.0.ffn_up.weight": ("Q4_1", rng.normal(size=(16, 96)) + 0.5),
               "blk.0.ffn_down.weight": ("Q8_0", rng.normal(size=(4, 128)))}
    decoded = write_quantized_gguf(tmp_path / "q.gguf", tensors)
    _, infos, _ = read_header(tmp_path / "q.gguf")
    assert [(t.name, t.shape) for t in infos] == [(n, x.shape) for n, (_, x) in tensors.items()]
    got = mlx_weights(tmp_path / "q.gguf", infos, {}, mx.float32)
    for name, want in decoded.items():
        w = np.array(got[hf_name(name, tmp_path / "q.gguf")])
        assert w.shape == want.shape and np.abs(w - want).max() <= 2e-3 * np.abs(want).max(), name
