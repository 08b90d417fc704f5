"""The early-exit target: one forward, two logits, exactly what the model itself computes."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache, trim_prompt_cache

from mirror_mlx.engine.model_parts import trimmable_cache
from mirror_mlx.engine.target import EarlyExitTarget, top_k
from tests.models import CONFIGS, demo_target, tiny_model
from tests.support import check_two_logits


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_early_logits_equal_truncated_model_for_every_family(name):
    model = tiny_model(name)
    tokens = mx.array([[1, 5, 9, 3, 7, 2, 8, 11, 4, 6]])
    for exit_layer in (1, 2, len(model.layers) - 1):
        if name == "gemma3_text" and exit_layer < 3:
            continue  # the truncation oracle needs the first global layer
        check_two_logits(model, tokens, exit_layer)


def test_early_logits_on_stories260K_at_every_layer():
    model, tokenizer = demo_target()
    tokens = mx.array([tokenizer.encode("Once upon a time, there was a little dog")])
    for exit_layer in range(1, 5):
        check_two_logits(model, tokens, exit_layer)


def test_cache_is_updated_once_and_matches_a_plain_forward():
    model, tokenizer = demo_target()
    prompt = tokenizer.encode("Tom and Lily went to the park")
    target = EarlyExitTarget(model, 2)
    cache = trimmable_cache(target.model)
    mx.eval(target.forward(mx.array([prompt]), cache))
    assert all(c.offset == len(prompt) for c in cache)
    _, final = target.forward(mx.array([[42]]), cache)
    target.remove()
    plain_cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=plain_cache)
    assert mx.allclose(final, model(mx.array([[42]]), cache=plain_cache), atol=1e-5)


def test_sliding_window_layers_get_trimmable_caches():
    model = tiny_model("gemma3_text")
    assert any(isinstance(c, RotatingKVCache) for c in make_prompt_cache(model))
    target = EarlyExitTarget(model, 3)
    cache = trimmable_cache(target.model)
    assert all(isinstance(c, KVCache) for c in cache)
    tokens = mx.array([list(range(1, 13))])
    mx.eval(target.forward(tokens, cache))
    assert trim_prompt_cache(cache, 3) == 3
    assert all(c.offset == 9 for c in cache)


@pytest.mark.parametrize("exit_layer", [0, 5, -1])
def test_exit_layer_out_of_range_is_refused(exit_layer):
    model, _ = demo_target()
    with pytest.raises(ValueError, match=r"outside 1\.\.4"):
        EarlyExitTarget(model, exit_layer)


def test_top_k_sorted_and_excluded_token_rule():
    logits = mx.array([[0.0, 3.0, 1.0, 2.0], [4.0, 3.0, 2.0, 1.0]])
    ids, logprobs = top_k(logits, 2)
    assert ids.tolist() == [[1, 3], [0, 1]]
    assert mx.allclose(logprobs[0], mx.array([3.0, 2.0]) - mx.logsumexp(logits[0])).item()
    ids, _ = top_k(logits, 2, exclude=[1, -1])
    assert ids.tolist() == [[3, 2], [0, 1]]
