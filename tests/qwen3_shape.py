"""Random-weight drafts of Qwen3-0.6B's exact shape, with a synthetic tokenizer of its size.

There is no hub here, so the tokenizer is a `tokenizers` WordLevel vocabulary: the words of the
verification prompts (so they encode to real ids), then filler words up to the requested size.
Used by tests/test_coreml_convert.py (2 layers) and scripts/ane_real_size.py (28 layers).
"""

import json
from pathlib import Path
from typing import Sequence

QWEN3_06B = dict(
    model_type="qwen3", hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
    tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
)
TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play "
        "The sun was shining and the birds were singing in the tall green trees.")


def synthetic_tokenizer(out: Path, size: int, specials: Sequence[str] = ("<unk>", "<|endoftext|>"),
                        text: str = TEXT) -> None:
    """tokenizer.json + tokenizer_config.json of exactly `size` tokens (specials first)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = list(dict.fromkeys(list(specials) + text.replace(",", " ,").replace(".", " .").split()))
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"w{i}": i for i in range(len(vocab), size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials[0]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": specials[0], "eos_token": specials[-1]}))


def qwen3_draft(out: Path, layers: int, tokenizer_size: int = 151669, seed: int = 0, dtype: str = "bfloat16",
                **overrides) -> Path:
    """A random Qwen3-0.6B-shaped mlx-lm folder with `layers` layers (mlx-lm's own classes and
    save_model/save_config); qk-norm weights are randomised so that path is really exercised.
    The tokenizer is smaller than the vocabulary by default, as Qwen3's is (151,669 of 151,936)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, save_config, save_model

    config = dict(QWEN3_06B, num_hidden_layers=layers, **overrides)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    norms = [(n, 1.0 + 0.2 * mx.random.normal(p.shape)) for n, p in tree_flatten(model.parameters())
             if n.endswith("norm.weight")]
    model.load_weights(norms, strict=False)
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    save_model(out, model)
    save_config(dict(config, torch_dtype=dtype), out / "config.json")
    synthetic_tokenizer(out, tokenizer_size)
    return out
