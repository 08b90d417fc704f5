"""The Speculative-Streaming draft: mask, cache, save/load, training, rollout, bad input."""

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.models.cache import make_prompt_cache

from mirror_mlx.drafts.ss.draft import SSDraft
from mirror_mlx.drafts.ss.model import Model, ModelArgs, is_ss_draft, load_ss_draft, save_ss_draft, ss_forward
from mirror_mlx.train.ss_draft import TrainConfig, TrainError, train
from mirror_mlx.cli import main as cli
from mirror_mlx.corpus import CORPUS
from mirror_mlx.demo import DRAFT as LLAMA2XS
from mirror_mlx.demo import SS_DRAFT as SS_DEMO
from mirror_mlx.demo import TARGET
from mirror_mlx.drafts.mlx_draft import MLXDraft


def tiny(streams: int = 3, stream_layers: int = 2, layers: int = 3, seed: int = 0) -> Model:
    mx.random.seed(seed)
    args = ModelArgs(model_type="ss_llama", hidden_size=32, num_hidden_layers=layers, intermediate_size=64,
                     num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64,
                     num_streams=streams, stream_layers=stream_layers)
    model = Model(args)
    model.stream_embeddings = mx.random.normal(model.stream_embeddings.shape)  # make streams matter
    mx.eval(model.parameters())
    return model


def tokens(B: int, L: int, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(3, 64, (B, L)).astype(np.int32))


def test_main_rows_equal_the_same_weights_without_streams():
    model, x = tiny(), tokens(2, 12)
    out = ss_forward(model, x)
    assert out.main.shape == (2, 12, 64) and out.streams.shape == (2, 3, 12, 64)
    plain = model(x)  # llama forward, no stream rows anywhere
    assert mx.allclose(out.main, plain, atol=1e-5).item()
    model.stream_embeddings = model.stream_embeddings * 3 + 1  # streams change, main rows must not
    out2 = ss_forward(model, x)
    assert mx.array_equal(out2.main, out.main).item()
    assert not mx.allclose(out2.streams, out.streams).item()


def test_stream_j_sees_main_prefix_and_lower_streams_only():
    model, x = tiny(), tokens(1, 10)
    out = ss_forward(model, x)
    y = np.array(x)
    y[0, 6] = (y[0, 6] + 1) % 64  # change token 6: rows 0..5 (main and streams) must not move
    out2 = ss_forward(model, mx.array(y))
    assert mx.allclose(out.streams[:, :, :6], out2.streams[:, :, :6], atol=1e-5).item()
    assert not mx.allclose(out.streams[:, :, 6:], out2.streams[:, :, 6:]).item()
    P = np.array(model.stream_embeddings)
    P[2] += 1.0  # stream 3's embedding: streams 1 and 2 must not move
    model.stream_embeddings = mx.array(P)
    out3 = ss_forward(model, x)
    assert mx.allclose(out.streams[:, :2], out3.streams[:, :2], atol=1e-5).item()
    assert not mx.allclose(out.streams[:, 2], out3.streams[:, 2]).item()


def test_cache_holds_main_rows_only():
    model = tiny()
    out = ss_forward(model, tokens(2, 7))
    assert all(k.shape[2] == 7 and v.shape[2] == 7 for k, v in out.kv)  # no stream rows
    draft = SSDraft(model)
    context = np.array(tokens(1, 15, seed=1))[0].tolist()
    draft.rollout(context, [[5], [6, 7]], gamma=5)
    ref = make_prompt_cache(model)
    model(mx.array([context]), cache=ref)
    for c, r in zip(draft.cache, ref):
        assert c.offset == len(context)
        assert mx.allclose(c.state[0][..., :c.offset, :], r.state[0][..., :r.offset, :], atol=1e-5).item()
    draft.rollout(context[:10] + [9, 9], [[5]], gamma=3)  # diverged context: trimmed, then extended
    assert draft.cached == context[:10] + [9, 9] and draft.cache[0].offset == 12


def test_save_load_round_trip(tmp_path):
    model = tiny()
    save_ss_draft(model, tmp_path / "d", tokenizer_from=LLAMA2XS)
    assert is_ss_draft(tmp_path / "d") and not is_ss_draft(LLAMA2XS) and not is_ss_draft(tmp_path)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["num_streams"] == 3 and config["stream_layers"] == 2
    loaded, tok = load_ss_draft(tmp_path / "d")
    x = tokens(1, 9)
    a, b = ss_forward(model, x), ss_forward(loaded, x)
    assert mx.array_equal(a.main, b.main).item() and mx.array_equal(a.streams, b.streams).item()
    assert tok.encode("Once upon a time")[:2] == [1, 403]
    with pytest.raises(ValueError, match="not a Speculative-Streaming draft"):
        load_ss_draft(LLAMA2XS)


def test_save_keeps_an_init_models_rope_scaling_and_biases(tmp_path):
    """An --init-from model's RoPE scaling and attention biases are written, so the saved draft is the trained one."""
    mx.random.seed(0)
    model = Model(ModelArgs(model_type="ss_llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                            num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=64, num_streams=2, stream_layers=1,
                            attention_bias=True, rope_scaling={"type": "linear", "factor": 4.0}))
    mx.eval(model.parameters())
    save_ss_draft(model, tmp_path / "d")
    loaded, _ = load_ss_draft(tmp_path / "d", with_tokenizer=False)
    x = tokens(1, 9)
    assert mx.array_equal(ss_forward(model, x).streams, ss_forward(loaded, x).streams).item()


def test_rollout_windows_are_the_drafts_greedy_text():
    model = tiny(seed=3)
    context = np.array(tokens(1, 20, seed=2))[0].tolist()
    stems = [[7], [4, 8], [4, 5, 9], [4, 5, 6, 10]]  # spine-shaped, as the engine sends them
    ss, plain = SSDraft(model, trust_streams=False), MLXDraft(model)
    r = ss.rollout(context, stems, gamma=6)
    assert r.windows == plain.rollout(context, stems, gamma=6).windows  # main stream = plain greedy
    assert all(len(w) == 6 for w in r.windows) and 1 <= r.forwards <= 6 + 1 and r.tokens == 6  # + the unseen context
    assert ss.rollout([], [[1, 4]], 4).windows == plain.rollout([], [[1, 4]], 4).windows
    assert ss.rollout(context, stems, 0).windows == [[], [], [], []]
    with pytest.raises(ValueError):
        ss.rollout(context, [[4], []], 3)


def test_next_rollout_recalls_the_spine_and_the_reused_branch_without_a_forward():
    model = tiny(seed=4)
    context = np.array(tokens(1, 20, seed=5))[0].tolist()
    ss, plain = SSDraft(model, trust_streams=False), MLXDraft(model)
    spine = ss.rollout(context, [[7]], gamma=6).windows[0]  # the window the target now verifies
    stems = [spine[:r] + [v] for r in range(7) for v in (3, 11)]
    first = ss.rollout(context + [7], stems, gamma=6)
    assert ss.stats.recalled >= 1 + 5 and first.forwards == max(ss.stats.branch_forwards)  # 7 and the window's fed tokens; no spine forward
    a = 2  # the target accepted ŷ1, ŷ2 and corrected to 11: the next window is w(2, 11)
    reused = first.windows[stems.index(spine[:a] + [11])]
    context2 = context + [7] + spine[:a] + [11]
    stems2 = [reused[:r] + [v] for r in range(7) for v in (5, 9)]
    second = ss.rollout(context2, stems2, gamma=6)
    assert ss.stats.recalled >= a + 1 + 5  # ŷ1 ŷ2 from the spine, 11 and w's verified tokens from its row
    assert second.windows == plain.rollout(context2, stems2, gamma=6).windows  # recalled keys/values are right
    assert ss.cached == context2 and ss.cache[0].offset == len(context2)  # committed tokens only
    ref = make_prompt_cache(model)
    model(mx.array([context2]), cache=ref)
    for c, r in zip(ss.cache, ref):
        n = len(context2)
        assert mx.allclose(c.state[0][..., :n, :], r.state[0][..., :n, :], atol=1e-5).item()
        assert mx.allclose(c.state[1][..., :n, :], r.state[1][..., :n, :], atol=1e-5).item()
    ss.reset()  # nothing to recall: the unseen tokens take a forward of their own, counted
    again = ss.rollout(context2, stems2, gamma=6)
    assert again.windows == second.windows and again.forwards == max(ss.stats.branch_forwards) + 1


def test_a_window_fed_before_the_rollout_leaves_one_token_per_branch_and_the_same_windows():
    model = tiny(seed=6)
    context = np.array(tokens(1, 20, seed=7))[0].tolist()
    stems = [[7], [4, 8], [4, 5, 9], [4, 5, 6, 10]]
    cold = SSDraft(model, trust_streams=False).rollout(context, stems, gamma=5)
    ss = SSDraft(model, trust_streams=False)
    assert ss.sync(context + [4, 5, 6]) >= 1  # (mirror's prepare, while the target runs its prefix)
    warm = ss.rollout(context, stems, gamma=5)
    assert warm.windows == cold.windows and warm.forwards == max(ss.stats.branch_forwards)  # no feed of its own
    assert ss.cached == context  # committed tokens only, as after any rollout
    assert ss.sync(context + [4, 5, 6]) == 0  # the spine comes back from the rollout: no forward


@pytest.mark.skipif(not SS_DEMO.is_dir(), reason="the demo SS draft (mirror_mlx/demo/ss_draft) is missing from this checkout")
def test_trained_streams_save_forwards():
    draft = SSDraft.from_path(SS_DEMO, trust_streams=False)
    plain = MLXDraft(draft.model)
    from mlx_lm.utils import load_tokenizer
    context = load_tokenizer(TARGET).encode("Once upon a time, there was a little girl named Lily. She loved to")
    top8 = np.argsort(-np.array(draft.model(mx.array([context]))[0, -1]))[:8].tolist()
    stems = [[v] for v in top8]  # plausible candidates, as the early exit would send
    r = draft.rollout(context, stems, gamma=7)
    assert r.windows == plain.rollout(context, stems, gamma=7).windows
    per_branch = draft.stats.branch_forwards
    assert np.mean(per_branch) < 6, f"streams rarely agree: forwards per branch {per_branch}"
    assert all(sum(e) == 7 for e in draft.stats.emitted) and max(max(e) for e in draft.stats.emitted) > 1
    trusted = SSDraft(draft.model, trust_streams=True).rollout(context, stems, gamma=7)
    assert trusted.forwards <= min(5, r.forwards) and all(len(w) == 7 for w in trusted.windows)
    assert all(t[:4] == w[:4] for t, w in zip(trusted.windows, r.windows))  # the γ - S verified tokens


def test_training_lowers_loss_and_resumes_exactly(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(CORPUS.read_text().split("\n\n")[:40]))
    kw = dict(model=str(TARGET), corpus=str(corpus), layers=2, hidden=32, streams=2, stream_layers=1,
              steps=12, batch_size=8, lr=3e-3, samples=32, seq_len=24, prompt_min=4, prompt_max=8,
              holdout=10, checkpoint_every=4)
    summary = train(TrainConfig(out=str(tmp_path / "a"), **kw), progress=False)
    assert summary["val_after"]["loss"] < summary["val_before"]["loss"]
    assert is_ss_draft(tmp_path / "a") and (tmp_path / "a" / "tokenizer.json").is_file()
    cfg = TrainConfig(out=str(tmp_path / "b"), **kw)
    assert train(cfg, progress=False, stop_after=6) == {"stopped_at": 6}
    assert not is_ss_draft(tmp_path / "b")
    train(cfg, progress=False, log=lambda s: None)  # resumes at step 6
    a = mx.load(str(tmp_path / "a" / "model.safetensors"))
    b = mx.load(str(tmp_path / "b" / "model.safetensors"))
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    with pytest.raises(TrainError, match="other settings"):
        train(TrainConfig(out=str(tmp_path / "b"), **dict(kw, lr=1e-3)), progress=False)


def test_too_few_samples_for_a_held_out_tenth_is_refused_before_any_work(tmp_path):
    with pytest.raises(TrainError, match="--samples 8 leaves none for the held-out tenth: give at least 10"):
        train(TrainConfig(model=str(tmp_path / "absent"), out=str(tmp_path / "o"), corpus=str(tmp_path / "c.txt"),
                          samples=8), progress=False)


def _cli(*args: str):
    args = args if "--holdout" in args else args + ("--holdout", "0")
    return CliRunner().invoke(cli, ["train-draft", "--model", str(TARGET), "--out", "/nonexistent/x", *args])


def test_bad_input_gives_clear_usage_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n\n")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("Caf\xe9 au lait.\n\nUne histoire.".encode("latin-1"))
    good = tmp_path / "good.txt"
    good.write_text("Once upon a time there was a cat.\n\nThe cat sat on a mat.")
    cases = [
        (["--corpus", str(empty)], "is empty"),
        (["--corpus", str(latin)], "not UTF-8"),
        (["--corpus", str(tmp_path / "missing.txt")], "does not exist"),
        (["--corpus", str(good), "--streams", "0"], "--streams must be at least 1"),
        (["--corpus", str(good), "--holdout", "5"], "not more than --holdout"),
        (["--corpus", str(good), "--layers", "2", "--stream-layers", "3"], "cannot exceed --layers"),
        (["--corpus", str(good), "--init-from", str(LLAMA2XS), "--stream-layers", "6"],
         "cannot exceed the draft's layers"),
        (["--corpus", str(good), "--init-from", str(LLAMA2XS), "--layers", "3"], "disagrees with --init-from"),
    ]
    other = tmp_path / "other_tok"
    shutil.copytree(LLAMA2XS, other)
    (other / "tokenizer.model").unlink()
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = [k for k, v in vocab.items() if v in (300, 301)]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, different tokenizer
    (other / "tokenizer.json").write_text(json.dumps(tj))
    cases.append((["--corpus", str(good), "--init-from", str(other)], "does not share the target's tokenizer"))
    for args, message in cases:
        result = _cli(*args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)
    with pytest.raises(ValueError, match="stream_layers"):
        tiny(stream_layers=4, layers=3)
    with pytest.raises(ValueError, match="num_streams"):
        tiny(streams=0)


def test_init_from_a_qwen3_model_is_refused_in_one_sentence(tmp_path):
    """The SS draft is a plain llama decoder: a qwen3 (q/k norms), float or 4-bit, is refused naming the flag."""
    from tests.models import save_tiny_model

    qwen3 = save_tiny_model(tmp_path / "qwen3", "qwen3", vocab_size=512)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(TARGET / name, qwen3 / name)
    good = tmp_path / "good.txt"
    good.write_text("Once upon a time there was a cat.\n\nThe cat sat on a mat.")
    result = _cli("--corpus", str(good), "--init-from", str(qwen3))
    assert result.exit_code == 2, result.output
    assert "--init-from" in result.output and "is a qwen3 model" in result.output
    assert "drop --init-from" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_init_from_a_4bit_llama_starts_from_its_dequantized_weights(tmp_path):
    from mlx.utils import tree_flatten
    from mlx_lm import convert, load
    from mlx_lm.utils import dequantize_model

    from mirror_mlx.drafts.ss.model import config_args, new_model

    quantized = tmp_path / "llama2xs-4bit"
    convert(str(LLAMA2XS), str(quantized), quantize=True, q_bits=4, q_group_size=32)
    draft = new_model(config_args(quantized, num_streams=2, stream_layers=1), quantized)
    expected = dict(tree_flatten(dequantize_model(load(str(quantized))[0]).parameters()))
    got = dict(tree_flatten(draft.parameters()))
    assert set(got) == set(expected) | {"stream_embeddings"}
    assert all(got[k].dtype == mx.float32 and mx.array_equal(got[k], expected[k].astype(mx.float32)).item()
               for k in expected)


def test_a_jsonl_corpus_distils_the_targets_replies_to_chats(tmp_path):
    """Each row is a conversation through the target's chat template, then the target's greedy reply."""
    import json as json_

    from mlx_lm import load as mlx_load
    from tests.support import reference_greedy

    from tests.models import templated_target

    target = templated_target(tmp_path / "target")
    chats = tmp_path / "chats.jsonl"
    lines = [{"messages": [{"role": "user", "content": f"Tell me about the {w}"}]}
             for w in ("cat", "dog", "sun", "park", "ball", "tree", "sea", "car", "bird", "cake")]
    lines[1]["messages"].append({"role": "assistant", "content": "dropped: the target writes the reply"})
    chats.write_text("\n".join(json_.dumps(x) for x in lines) + "\n")
    cfg = TrainConfig(model=str(target), out=str(tmp_path / "d"), corpus=str(chats), layers=2, hidden=32,
                      streams=2, stream_layers=1, steps=4, batch_size=8, samples=16, seq_len=32, holdout=2)
    summary = train(cfg, progress=False)
    assert is_ss_draft(tmp_path / "d") and "val_after" in summary
    data = np.load(tmp_path / "d" / "checkpoint" / "data.npz")
    model, tok = mlx_load(str(target))
    rendered = {tuple(tok.apply_chat_template(x["messages"][:1], add_generation_prompt=True)) for x in lines[2:]}
    for row, start in zip(data["tokens"][:3], data["start"][:3]):
        assert tuple(row[:start]) in rendered  # a training conversation (the first 2 are held out), whole
        reply = reference_greedy(model, row[:start], len(row) - start)
        assert list(row[start:]) == reply
    with pytest.raises(TrainError, match="line 2 is not a chat"):
        chats.write_text(json_.dumps(lines[0]) + "\n" + '{"text": "no messages"}\n')
        train(cfg, progress=False)


def test_loading_an_ss_draft_prints_no_warning_about_its_model_type():
    """transformers does not know `ss_llama` and says so when the tokenizer is read; the tokenizer is plain.
    (A library user's process: without the command line's TRANSFORMERS_VERBOSITY.)"""
    script = f"from mirror_mlx.loading import load_model; load_model({str(SS_DEMO)!r})"
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_VERBOSITY"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "to instantiate a model of type" not in out.stderr, out.stderr
