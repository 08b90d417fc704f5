"""Tiny random mlx-lm models of several families, and the demo pair, for tests."""

from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import _get_classes, load

from mirror_mlx.corpus import CORPUS
from mirror_mlx.demo import DEMO_DIR as DEMO
from mirror_mlx.demo import DRAFT as DRAFT_PATH
from mirror_mlx.demo import TARGET as TARGET_PATH

DATA = CORPUS.parent
PERIOD = 426  # "." in the demo tokenizer: the demo target's greedy text reaches it within a dozen tokens

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
_GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, full_attention_interval=2)
RECURRENT = {  # families with recurrent state (an ArraysCache) mirror-mlx rolls back: vocab as BASE's (one draft)
    "qwen3_next": dict(BASE, **_GDN, model_type="qwen3_next", num_experts=0, num_experts_per_tok=0,
                       decoder_sparse_step=1, shared_expert_intermediate_size=0, mlp_only_layers=[],
                       moe_intermediate_size=0, rope_theta=10000.0, partial_rotary_factor=0.5,
                       max_position_embeddings=512),
    "qwen3_5": dict(model_type="qwen3_5", text_config=dict(BASE, **_GDN, model_type="qwen3_5_text",
                                                            max_position_embeddings=512)),
    "mamba2": dict(model_type="mamba2", num_heads=4, head_dim=16, vocab_size=97, hidden_size=32, intermediate_size=64,
                   state_size=8, num_hidden_layers=4, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1,
                   use_bias=False, use_conv_bias=True, tie_word_embeddings=True, time_step_limit=(0.001, 100.0),
                   time_step_rank=4),
    "lfm2": dict(model_type="lfm2", vocab_size=97, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
                 block_dim=64, block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                 block_ff_dim=96, layer_types=["conv", "full_attention", "conv", "conv"]),
    "nemotron_h": dict(model_type="nemotron_h", vocab_size=97, hidden_size=64, intermediate_size=96,
                       max_position_embeddings=512, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       attention_bias=False, mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False,
                       ssm_state_size=8, conv_kernel=4, n_groups=1, mlp_bias=False, layer_norm_epsilon=1e-5,
                       use_bias=False, use_conv_bias=True, hybrid_override_pattern=list("M*M-"),
                       time_step_limit=(0.001, 100.0)),
    "falcon_h1": dict(model_type="falcon_h1", vocab_size=97, hidden_size=64, intermediate_size=96, head_dim=16,
                      num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, mamba_d_ssm=64,
                      mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4,
                      max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False),
}
REFUSED = {  # families mirror-mlx refuses at load (recurrent state that no rollback reaches)
    "mamba": dict(model_type="mamba", vocab_size=512, hidden_size=64, intermediate_size=128, state_size=8,
                  num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4),
}
FAMILIES = {**CONFIGS, **RECURRENT, **REFUSED}
CACHE_FAMILIES = ["gemma3_text", "llama_tied", "mistral", "qwen2", "qwen3"]  # (llama_untied: mistral as built here)


def tiny_model(name: str, seed: int = 0, **overrides):
    """A randomly initialised float32 model of family `name` (see CONFIGS, RECURRENT and REFUSED), with config overrides."""
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

TOOL_TEMPLATE = (  # a Qwen-like chat template with tools: mlx-lm recognizes its <tool_call> markers (json_tools)
    "{{ bos_token }}{% if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}"
    "{% for tool_call in m.tool_calls or [] %}{% if tool_call.function is defined %}"
    "{% set tool_call = tool_call.function %}{% endif %}"
    "<tool_call>{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}</tool_call>"
    "{% endfor %}{{ eos_token }}\n{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]


def templated_target(folder: Path) -> Path:
    """A copy of the demo target whose tokenizer has TEMPLATE as its chat template."""
    import json
    import shutil

    shutil.copytree(TARGET_PATH, folder)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), chat_template=TEMPLATE)))
    return folder


def swapped_vocab(folder, to):
    """A copy of `folder` whose tokenizer swaps two ids: same size, another vocabulary."""
    import json
    import shutil

    shutil.copytree(folder, to)
    (to / "tokenizer.model").unlink()  # transformers would rebuild the vocabulary from it
    tok = json.loads((to / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "▁the", "▁a"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (to / "tokenizer.json").write_text(json.dumps(tok))
    return to


def with_config(folder, to, **config):
    """A copy of model folder `folder` with `config` set in its config.json."""
    import json
    import shutil

    shutil.copytree(folder, to)
    path = to / "config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **config)))
    return to


def lora_adapter(folder):
    """A small LoRA adapter for the demo target, as mlx_lm.lora writes it (random, so it changes the output)."""
    import json

    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(str(TARGET_PATH))
    params = {"rank": 4, "scale": 20.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, params)
    mx.random.seed(0)
    weights = {k: mx.random.normal(v.shape) * 0.5 for k, v in tree_flatten(model.trainable_parameters())
               if k.endswith(("lora_a", "lora_b"))}
    folder.mkdir()
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    (folder / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora", "num_layers": 2,
                                                             "lora_parameters": params}))
    return folder
