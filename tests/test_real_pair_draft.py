"""The real pair's draft: SmolLM2-135M-Instruct's first 6 layers, as they are, under the layer trained over them
here, built offline from the target and the few MB of trained parts the package ships (`real-pair`)."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mirror_mlx.loading import load_model as load

from mirror_mlx.convert.real_pair import TRAINED, is_current, sha256
from mirror_mlx.drafts.distilled.model import MODEL_TYPE, from_trained, save_trained, trained_meta
from mirror_mlx.engine.model_parts import flat
from mirror_mlx.train.distill_data import unpack_ids

IDS = Path(__file__).resolve().parent.parent / "data" / "distill" / "smollm2-135m-instruct.npz"
EVAL_REPLIES = 8  # the evaluation part's first greedy replies (the target's own tokens), never trained on


@pytest.fixture
def pair(smollm2, smollm2_draft):
    """The target, the draft (loaded afresh: a test may change its weights) and the draft's folder."""
    return load(str(smollm2))[0], load(str(smollm2_draft))[0], smollm2_draft


def greedy_agreement(draft, pairs) -> float:
    """How often the draft's argmax is the target's greedy token, fed the target's own reply (teacher forcing)."""
    hit = n = 0
    kept = np.array(draft.kept_ids)
    for prompt, reply in pairs:
        x = mx.array(np.concatenate([prompt, reply[:-1]])[None])
        guess = kept[np.array(mx.argmax(draft.kept_logits(x)[0, len(prompt) - 1:], axis=-1))]
        hit, n = hit + int((guess == reply).sum()), n + len(reply)
    return hit / n


def test_the_draft_is_the_targets_first_layers_under_the_shipped_trained_layer(pair):
    target, draft, folder = pair
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == MODEL_TYPE and config["trained_sha256"] == sha256(TRAINED)
    frozen, trained = int(config["trained_on"]["frozen"]), int(config["trained_on"]["trained"])
    assert (frozen, trained) == (6, 1) and len(draft.layers) == 7
    mine, theirs = dict(flat(draft.parameters())), dict(flat(target.parameters()))
    for k, v in theirs.items():
        if k.startswith("model.layers.") and int(k.split(".")[2]) < frozen or k == "model.embed_tokens.weight":
            assert mx.array_equal(mine[k], v), k
    shipped = mx.load(str(TRAINED))
    for k, v in shipped.items():
        assert mx.array_equal(mine[k], v.astype(mine[k].dtype)), k
    assert mx.array_equal(mine["head.weight"], theirs["model.embed_tokens.weight"][draft.kept_ids])
    assert TRAINED.stat().st_size < 16e6  # the trained parts alone ship; the draft is hundreds of MB


def test_the_trained_layer_agrees_with_the_target_where_the_untrained_start_does_not(pair):
    target, draft, _ = pair
    pairs = [(p, r) for k, p, r in unpack_ids(IDS) if k.startswith("eval-") and "-t0-" in k][:EVAL_REPLIES]
    trained = greedy_agreement(draft, pairs)
    start = dict(flat(target.parameters()))  # the trained layer's start: the target's layer 6, its norm
    draft.load_weights([(k, start[k]) for k, _ in flat(draft.parameters()) if k in start and "layers.6." in k
                        or k == "model.norm.weight"], strict=False)
    untrained = greedy_agreement(draft, pairs)
    assert trained >= 0.15 and untrained < 0.08, (trained, untrained)
    assert trained >= float(trained_meta(TRAINED)["agreement"]) - 0.08, trained  # the probe's 40 replies


def test_a_changed_trained_file_remakes_the_draft_and_a_foreign_one_is_refused(pair, tmp_path):
    target, draft, folder = pair
    assert is_current(folder)
    other = save_trained(draft, tmp_path / "other.safetensors", {"agreement": "0"})
    assert not is_current(folder, other)
    config = json.loads((folder.parent / "target" / "config.json").read_text())
    bad = tmp_path / "bad.safetensors"
    mx.save_safetensors(str(bad), dict(mx.load(str(other)), **{"model.layers.9.mlp.up_proj.weight": mx.zeros(1)}),
                        metadata=trained_meta(other))
    with pytest.raises(ValueError, match="holds weights a 6\\+1-layer draft has not"):
        from_trained(target, config, bad)
