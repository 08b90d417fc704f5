"""`mirror-mlx generate` as a user meets it: text, stats, JSON, and one-line errors."""

import json
import shutil

from click.testing import CliRunner
from mlx_lm import load

from mirror_mlx.cli import main
from mirror_mlx.pipeline import load as load_pipeline
from tests.models import DRAFT_PATH, TARGET_PATH
from tests.test_engine import mlx_greedy


def run(*args):
    return CliRunner().invoke(main, ["generate", *args])


def test_json_output_has_tokens_text_and_every_stat():
    result = run("--prompt", "Once upon a time", "--max-tokens", "24", "--json", "--mode", "mirror")
    assert result.exit_code == 0, result.output
    # the JSON line (a first call without a profile also says on stderr that it calibrated)
    out = json.loads(next(line for line in result.output.splitlines() if line.startswith("{")))
    model, tokenizer = load(str(TARGET_PATH))
    assert out["tokens"] == mlx_greedy(model, tokenizer.encode("Once upon a time"), 24)
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


def test_bad_options_are_usage_errors_without_traceback():
    for args, message in [(("--kappa", "0"), "kappa must be at least 1"),
                          (("--gamma", "0"), "gamma must be at least 1"),
                          (("--exit-layer", "7"), "exit layer 7 is outside 1..4"),
                          (("--max-tokens", "1000"), "exceeds the target's context"),
                          (("--model", "/no/such/model"), "does not exist")]:
        result = run(*args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and "Traceback" not in result.output


def test_a_draft_with_another_tokenizer_is_refused(tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(DRAFT_PATH, draft)
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "▁the", "▁a"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    result = run("--model", str(TARGET_PATH), "--draft-model", str(draft), "--max-tokens", "5")
    assert result.exit_code == 2 and "tokenizers differ" in result.output
    try:
        load_pipeline(TARGET_PATH, draft)
    except ValueError as e:
        assert "use a draft trained with the target's tokenizer" in str(e)
    else:
        raise AssertionError("mismatched tokenizers were accepted")


def test_the_demo_uses_its_exit_adapter_and_refuses_it_at_another_layer():
    result = run("--max-tokens", "40", "--json", "--mode", "mirror", "--kappa", "8", "--gamma", "7")
    stats = json.loads(result.output.strip().splitlines()[-1])["stats"]
    assert stats["reuse_rate"] > 0.8  # the shipped layer-2 adapter: most corrections are precomputed
    result = run("--exit-layer", "3", "--max-tokens", "5")
    assert result.exit_code == 2 and "trained for exit layer 2, not 3" in result.output
    assert run("--exit-layer", "3", "--exit-adapter", "none", "--max-tokens", "5").exit_code == 0
