"""Tiny random mlx-lm models of several families, and the demo pair, for tests."""

from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import _get_classes, load

from mirror_mlx.corpus import CORPUS
from mirror_mlx.demo_pair import DEMO_DIR as DEMO
from mirror_mlx.demo_pair import DRAFT as DRAFT_PATH
from mirror_mlx.demo_pair import TARGET as TARGET_PATH

DATA = CORPUS.parent

BASE = dict(
    hidden_size=64, num_hidden_layers=4, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97, head_dim=16,
)
CONFIGS = {
    "llama_tied": dict(BASE, model_type="llama", tie_word_embeddings=True),
    "llama_untied": dict(BASE, model_type="llama", tie_word_embeddings=False),
    "mistral": dict(BASE, model_type="mistral", tie_word_embeddings=False),
    "qwen2": dict(BASE, model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(BASE, model_type="qwen3", tie_word_embeddings=False, max_position_embeddings=512,
                  rope_theta=10000.0),
    "gemma3_text": dict(BASE, model_type="gemma3_text", num_hidden_layers=6, sliding_window=4,
                        sliding_window_pattern=3, query_pre_attn_scalar=16),
}
REFUSED = {  # families mirror-mlx refuses at load (recurrent state, an ArraysCache: nothing to roll back)
    "mamba": dict(model_type="mamba", vocab_size=512, hidden_size=64, intermediate_size=128, state_size=8,
                  num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4),
}
FAMILIES = {**CONFIGS, **REFUSED}


def tiny_model(name: str, seed: int = 0, **overrides):
    """A randomly initialised float32 model of family `name` (see CONFIGS and REFUSED), with config overrides."""
    config = dict(FAMILIES[name], **overrides)
    if config["model_type"] == "mistral":
        config["model_type"] = "llama"
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    mx.eval(model.parameters())
    return model


def demo_target():
    return load(str(TARGET_PATH))


def save_tiny_model(path: Path, name: str, seed: int = 0, **overrides) -> Path:
    """`tiny_model(name, seed, **overrides)` saved as an mlx-lm folder (weights + config), e.g. for a draft host."""
    from mlx_lm.utils import save_config, save_model

    config = dict(FAMILIES[name], **overrides)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, tiny_model(name, seed, **overrides))
    save_config(dict(config, model_type="llama" if config["model_type"] == "mistral" else config["model_type"]),
                path / "config.json")
    return path


TEMPLATE = (  # a small chat template for the demo tokenizer, which has none
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}{{ eos_token }}\n"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")


def templated_target(folder: Path) -> Path:
    """A copy of the demo target whose tokenizer has TEMPLATE as its chat template."""
    import json
    import shutil

    shutil.copytree(TARGET_PATH, folder)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), chat_template=TEMPLATE)))
    return folder
