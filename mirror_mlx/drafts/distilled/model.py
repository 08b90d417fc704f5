"""A distilled draft (model_type `mirror_distilled`): a llama's first layers, a trimmed head, real token ids.

The body is mlx-lm's LlamaModel with E + k layers: the target's first E (frozen in training) and k more,
initialised from the target's layers E..E+k-1 and trained. The head scores only the V kept ids (`kept_ids`,
stored with the weights), V/vocab of a full head's cost, and the forward returns logits over the whole
vocabulary, -inf off the kept ids, so every consumer reads real token ids. Our loaders give mlx-lm this module's
classes for its model_type (model_types.py).
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama

from .. import vocab as draft_vocab
from ...engine.model_parts import flat

if TYPE_CHECKING:
    from ...engine.recurrent import LayerCache

MODEL_TYPE = "mirror_distilled"


@dataclass
class ModelArgs(llama.ModelArgs):
    kept_size: int = 0  # V: rows of the trimmed head
    frozen_layers: int = 0  # E: the target's first layers, taken as they are (informational)
    target_layers: int = 0  # the target's depth (informational)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = llama.LlamaModel(args)
        self.head = nn.Linear(args.hidden_size, args.kept_size, bias=False)
        self.kept_ids = mx.zeros((args.kept_size,), dtype=mx.int32)
        self._index: Optional[mx.array] = None

    def full_index(self) -> mx.array:
        """For each vocabulary id, its row in the head's output, or V (the -inf column) when not kept."""
        if self._index is None:
            self._index = draft_vocab.full_index(self.kept_ids, self.args.vocab_size)
        return self._index

    def kept_logits(self, inputs: mx.array, cache: "Optional[list[LayerCache]]" = None) -> mx.array:
        """(..., V) logits over the kept ids (training and measurement use these)."""
        return self.head(self.model(inputs, cache))

    def __call__(self, inputs: mx.array, cache: "Optional[list[LayerCache]]" = None,
                 input_embeddings: Optional[mx.array] = None):
        return draft_vocab.full_logits(self.head(self.model(inputs, cache, input_embeddings)), self.full_index())

    def load_weights(self, *args, **kwargs):
        self._index = None
        return super().load_weights(*args, **kwargs)

    @property
    def layers(self):
        return self.model.layers


def config_for(target_config: dict, frozen: int, trained: int, kept_size: int) -> dict:
    """A draft's config.json from its target's: E + k layers, V kept ids, model_type mirror_distilled."""
    config = {k: v for k, v in target_config.items() if k not in ("quantization", "quantization_config")}
    config.update(model_type=MODEL_TYPE, architectures=["MirrorDistilledForCausalLM"],
                  num_hidden_layers=frozen + trained, kept_size=kept_size, frozen_layers=frozen,
                  target_layers=target_config["num_hidden_layers"], tie_word_embeddings=False)
    return config


def new_draft(target: nn.Module, target_config: dict, frozen: int, trained: int, kept_ids,
              init_layers: Optional[list] = None) -> Model:
    """A draft from a loaded (float) llama target: its embedding, its layers 0..E-1, then k layers copied from
    the target's `init_layers` (default E..E+k-1), its final norm, and the head initialised from the (tied or
    own) output rows of the kept ids."""
    kept = mx.array(sorted(int(i) for i in kept_ids), dtype=mx.int32)
    args = ModelArgs.from_dict(config_for(target_config, frozen, trained, int(kept.size)))
    draft = Model(args)
    inner = target.model
    source = list(range(frozen)) + list(init_layers if init_layers is not None else range(frozen, frozen + trained))
    if len(source) != frozen + trained or not all(0 <= i < len(inner.layers) for i in source):
        raise ValueError(f"init layers {init_layers} do not give {trained} of the target's {len(inner.layers)} layers")
    weights = {"model." + k: v for k, v in flat(inner.parameters()) if not k.startswith("layers.")}
    for mine, theirs in enumerate(source):
        for k, v in flat(inner.layers[theirs].parameters()):
            weights[f"model.layers.{mine}.{k}"] = v
    out = target.lm_head.weight if hasattr(target, "lm_head") else inner.embed_tokens.weight
    weights["head.weight"] = out[kept]
    weights["kept_ids"] = kept
    draft.load_weights(list(weights.items()), strict=True)
    mx.eval(draft.parameters())
    return draft


def save_draft(draft: Model, out: Path, tokenizer_from: Path, extra: Optional[dict] = None) -> Path:
    """The draft as a model folder: config.json, model.safetensors (kept_ids among the weights), tokenizer."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(flat(draft.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    for p in Path(tokenizer_from).iterdir():
        if p.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) or p.suffix in (".model", ".jinja"):
            shutil.copyfile(p, out / p.name)
    config = dict(vars(draft.args), **(extra or {}))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    return out


def save_trained(draft: Model, path: Path, meta: dict[str, str]) -> Path:
    """What a draft holds beyond its target: the trained layers, the final norm and the kept ids, float16 in one
    safetensors file (a few MB where the whole draft is hundreds: what a repository ships). The head stays the
    target's rows of the kept ids (frozen in training); `from_trained` builds the draft back."""
    frozen = draft.args.frozen_layers
    weights = {k: v.astype(mx.float16) for k, v in flat(draft.parameters())
               if k == "model.norm.weight" or (k.startswith("model.layers.") and int(k.split(".")[2]) >= frozen)}
    weights["kept_ids"] = draft.kept_ids
    trained = str(draft.args.num_hidden_layers - frozen)
    mx.save_safetensors(str(path), weights, metadata=dict(meta, frozen=str(frozen), trained=trained))
    return Path(path)


def trained_meta(path: Path) -> dict[str, str]:
    """The metadata `save_trained` wrote (the draft's shape and how it was trained)."""
    return cast(tuple[dict, dict], mx.load(str(path), return_metadata=True))[1]


def from_trained(target: nn.Module, target_config: dict, path: Path) -> Model:
    """The draft `save_trained` wrote, rebuilt over its (float) target: the target's embedding, first layers and
    head rows, the file's trained layers and norm in the target's dtype."""
    weights, meta = cast(tuple[dict[str, mx.array], dict], mx.load(str(path), return_metadata=True))
    kept = np.array(weights.pop("kept_ids"))
    draft = new_draft(target, target_config, int(meta["frozen"]), int(meta["trained"]), kept)
    unknown = sorted(set(weights) - {k for k, _ in flat(draft.parameters())})
    if unknown:
        raise ValueError(f"{path} holds weights a {meta['frozen']}+{meta['trained']}-layer draft has not "
                         f"({', '.join(unknown[:3])}): it was saved for another target")
    dtype = target.model.embed_tokens.weight.dtype
    draft.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=False)
    mx.eval(draft.parameters())
    return draft
