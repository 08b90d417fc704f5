"""`mirror-mlx generate` as a user meets it: text, stats, JSON, and one-line errors."""

import json

from click.testing import CliRunner
from mlx_lm import load

import pytest

from mirror_mlx.cli import main
from mirror_mlx.demo import SS_DRAFT
from mirror_mlx.pipeline import Pipeline, load_draft
from mirror_mlx.pipeline import load as load_pipeline
from tests.models import DRAFT_PATH, PERIOD, TARGET_PATH, swapped_vocab, with_config
from tests.support import assert_lossless, reference_greedy


def run(*args):
    return CliRunner().invoke(main, ["generate", *args])


def test_json_output_has_tokens_text_and_every_stat():
    result = run("--prompt", "Once upon a time", "--max-tokens", "24", "--json", "--mode", "mirror")
    assert result.exit_code == 0, result.output
    # the JSON line (a first call without a profile also says on stderr that it calibrated)
    out = json.loads(next(line for line in result.output.splitlines() if line.startswith("{")))
    model, tokenizer = load(str(TARGET_PATH))
    assert_lossless(out["tokens"], reference_greedy(model, tokenizer.encode("Once upon a time"), 24))
    assert out["text"] == tokenizer.decode(out["tokens"])
    for key in ("mean_accepted", "fallback_rate", "reuse_rate", "omega_kappa", "hidden_draft_fraction",
                "target_forwards", "draft_forwards", "tokens_per_second", "peak_memory_gb"):
        assert key in out["stats"], key
    assert out["stats"]["mode"] == "mirror" and out["stats"]["target_forwards"] < 24


def test_plain_output_streams_text_then_a_stats_line():
    result = run("--max-tokens", "20", "--mode", "sd")
    assert result.exit_code == 0
    assert ", there was a little girl named Lily" in result.stdout
    assert "accepted/forward" in result.stderr and "mode sd" in result.stderr


def test_each_mode_gives_the_same_greedy_text():
    texts = {mode: run("--max-tokens", "30", "--mode", mode, "--kappa", "4", "--gamma", "3").stdout
             for mode in ("ar", "sd", "mirror")}
    assert texts["ar"] == texts["sd"] == texts["mirror"]


def test_the_lookup_from_the_command_line():
    """--draft-model lookup (no draft model) and --lookup beside the demo draft: the greedy text, the lookup's
    tokens counted in the stats line."""
    prompt = "The dog ran to the park. The dog ran to the park. The dog"
    ar = run("--prompt", prompt, "--max-tokens", "30", "--mode", "ar").stdout
    for args in (("--draft-model", "lookup"), ("--lookup", "--mode", "sd", "--gamma", "3"),
                 ("--lookup", "--mode", "mirror", "--kappa", "2", "--gamma", "3")):
        result = run("--prompt", prompt, "--max-tokens", "30", *args)
        assert result.exit_code == 0, result.output
        assert result.stdout == ar and "accepted: lookup " in result.stderr, args
    for args, message in [(("--lookup", "--mode", "ar"), "--mode ar is the target alone and takes no lookup"),
                          (("--draft-model", "lookup", "--mode", "mirror"), "mode 'mirror' needs a draft model"),
                          (("--lookup", "--mode", "sd", "--ngram-min", "4"), "--ngram-min must be at most 3")]:
        result = run("--max-tokens", "4", "--gamma", "3", *args)
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output


def test_the_recycled_draft_from_the_command_line():
    """--draft-model recycle (no draft model): the greedy text, the recycled and lookup tokens counted."""
    prompt = "The dog ran to the park. The dog ran to the park. The dog"
    ar = run("--prompt", prompt, "--max-tokens", "30", "--mode", "ar").stdout
    result = run("--prompt", prompt, "--max-tokens", "30", "--draft-model", "recycle")
    assert result.exit_code == 0 and result.stdout == ar, result.output
    assert "accepted: recycled " in result.stderr and ", lookup " in result.stderr


def test_bad_options_are_usage_errors_without_traceback():
    for args, message in [(("--kappa", "0"), "kappa must be at least 1"),
                          (("--gamma", "0"), "gamma must be at least 1"),
                          (("--exit-layer", "7"), "exit layer 7 is outside 1..4"),
                          (("--mode", "mirror", "--kappa", "2", "--gamma", "3", "--branches", "9"),
                           "--branches must be at most 8 (got 9): a step has --kappa*(--gamma+1) = 2*(3+1) = 8"),
                          (("--max-tokens", "1000"), "exceeds the target's context"),
                          (("--model", "/no/such/model"), "does not exist")]:
        result = run(*args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and "Traceback" not in result.output


def test_a_draft_with_another_tokenizer_is_refused(tmp_path):
    draft = swapped_vocab(DRAFT_PATH, tmp_path / "draft")
    result = run("--model", str(TARGET_PATH), "--draft-model", str(draft), "--max-tokens", "5")
    assert result.exit_code == 2 and "tokenizers differ" in result.output
    with pytest.raises(ValueError, match="tokenizers differ .*use a draft trained with the target's tokenizer"):
        load_pipeline(TARGET_PATH, draft)
    ss = swapped_vocab(SS_DRAFT, tmp_path / "ss")
    with pytest.raises(ValueError, match="tokenizers differ .*use a draft trained with the target's tokenizer"):
        load_draft(ss, load(str(TARGET_PATH))[1])


PROMPT = "Once upon a time"
KNOBS = dict(kappa=2, gamma=3, exit_layer=2)  # explicit, so no calibration runs


def mlx_lm_stops(folder, max_tokens):
    """mlx-lm's greedy tokens of PROMPT from `folder`, cut where its own end-of-sequence ids stop them."""
    model, tokenizer = load(str(folder))
    greedy = reference_greedy(model, tokenizer.encode(PROMPT), max_tokens)
    stop = next((i for i, t in enumerate(greedy) if t in tokenizer.eos_token_ids), len(greedy))
    return greedy[:stop], tokenizer.eos_token_ids


def test_a_pair_listing_several_eos_ids_in_config_loads_and_stops_in_every_mode(tmp_path, capfd):
    """As in many real pairs (Llama-3.1/3.2 Instruct: [128001, 128008, 128009]), both sides list several
    end-of-sequence ids: a plain draft (config.json) and an SS draft (generation_config.json, which
    mlx-lm reads over config.json) load silently and every mode stops at them."""
    target = with_config(TARGET_PATH, tmp_path / "target", eos_token_id=[2, PERIOD])
    want, eos = mlx_lm_stops(target, 30)
    assert eos == {2, PERIOD} and 0 < len(want) < 20  # the stop is reached, before max_tokens
    for draft_folder in (DRAFT_PATH, SS_DRAFT):
        ss = draft_folder == SS_DRAFT
        draft = with_config(draft_folder, tmp_path / draft_folder.name, **({} if ss else {"eos_token_id": [2, PERIOD]}))
        if ss:
            (draft / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, PERIOD]}))
        pipe = load_pipeline(target, draft)
        try:
            for mode in ("ar", "sd", "mirror"):
                out = pipe.generate(PROMPT, max_tokens=30, mode=mode, **KNOBS)
                assert_lossless(out.tokens, want, (draft_folder.name, mode, out.tokens))
                assert out.finish_reason == "stop", (draft_folder.name, mode, out.tokens)
        finally:
            pipe.close()
    assert "note:" not in capfd.readouterr().err


def test_special_ids_that_differ_are_said_once_and_the_targets_decide(tmp_path, capfd):
    target = with_config(TARGET_PATH, tmp_path / "target", eos_token_id=[2, PERIOD])
    want, _ = mlx_lm_stops(target, 30)
    # the target stops at "." though its draft would not
    pipe = load_pipeline(target, DRAFT_PATH)
    err = capfd.readouterr().err.splitlines()
    notes = [line for line in err if "note:" in line]
    assert len(notes) == 1 and "end-of-sequence ids [2, 426] in the target, [2] in the draft" in notes[0], err
    assert "the target's decide" in notes[0]
    try:
        for mode in ("sd", "mirror"):
            out = pipe.generate(PROMPT, max_tokens=30, mode=mode, **KNOBS)
            assert_lossless(out.tokens, want, (mode, out.tokens))
            assert out.finish_reason == "stop", (mode, out.tokens)
    finally:
        pipe.close()
    # a draft that would stop at "." and begins with another bos: the target runs on past both
    draft = with_config(DRAFT_PATH, tmp_path / "draft", eos_token_id=[2, PERIOD])
    tok_config = draft / "tokenizer_config.json"
    tok_config.write_text(json.dumps(dict(json.loads(tok_config.read_text()), bos_token="</s>")))
    model, tokenizer = load(str(TARGET_PATH))
    recipe = load_draft(draft, tokenizer)
    notes = [line for line in capfd.readouterr().err.splitlines() if "note:" in line]
    assert len(notes) == 1 and "[2] in the target, [2, 426] in the draft; bos id 1 in the target, 2" in notes[0]
    pipe = Pipeline(model, tokenizer, recipe)
    try:
        prompt = tokenizer.encode(PROMPT)
        for mode in ("sd", "mirror"):
            out = pipe.generate(prompt, max_tokens=30, mode=mode, **KNOBS)
            assert_lossless(out.tokens, reference_greedy(model, prompt, 30), mode)
            assert out.finish_reason == "length", mode
    finally:
        pipe.close()


def test_the_demo_uses_its_exit_adapter_and_refuses_it_at_another_layer():
    result = run("--max-tokens", "40", "--json", "--mode", "mirror", "--kappa", "8", "--gamma", "7", "--branches", "64")
    stats = json.loads(result.output.strip().splitlines()[-1])["stats"]
    assert stats["reuse_rate"] > 0.8  # the shipped layer-2 adapter: most corrections are precomputed
    result = run("--exit-layer", "3", "--max-tokens", "5")
    assert result.exit_code == 2 and "trained for exit layer 2, not 3" in result.output
    assert run("--exit-layer", "3", "--exit-adapter", "none", "--max-tokens", "5").exit_code == 0
