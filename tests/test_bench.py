"""`mirror-mlx bench` on the demo pair: every mode runs, files are written, a wrong token fails the run.

(That widening keeps greedy text, which the headline benchmark relies on, is tests/test_widen.py.)
"""

import json

import pytest
from click.testing import CliRunner

import mirror_mlx.bench.run as bench_mod
from mirror_mlx.cli import main
from mirror_mlx.bench.grid import layer_value, parse_modes, parse_sweep
from mirror_mlx.bench.summary import Sample, summarize, table
from mirror_mlx.engine.stats import Stats

PNG = b"\x89PNG\r\n\x1a\n"
SMOKE = ["bench", "--prompts", "tinystories", "--limit", "2", "--max-tokens", "16", "--modes", "mirror,sd,mlx_sd,ar"]


def read(out):
    return json.loads((out / "results.json").read_text())


def is_png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG and path.stat().st_size > 1000


def test_smoke_every_mode_files_and_equal_tokens(tmp_path):
    out = tmp_path / "b"
    r = CliRunner().invoke(main, SMOKE + ["--decompose", "--out", str(out)])
    assert r.exit_code == 0, r.output
    for name in ("results.md", "speedup.png", "accepted.png", "latency.png", "timeline.png"):
        assert name == "results.md" or is_png(out / name), name
    rep = read(out)
    assert rep["equality_checked"] and "error" not in rep and len(rep["prompts"]) == 2
    rows = rep["summary"]["all"]
    assert set(rows) == {"mirror", "sd", "mlx_sd", "ar"}
    by_prompt: dict = {}
    for s in rep["samples"]:
        assert len(s["tokens"]) == 16 and s["stats"]["decode_seconds"] > 0
        by_prompt.setdefault(s["prompt"], {})[s["mode"]] = s["tokens"]
    for modes in by_prompt.values():  # the harness's own check, redone from the saved samples
        assert len(modes) == 4 and all(t == modes["ar"] for t in modes.values())
    assert rows["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert rows["mlx_sd"]["speedup_vs_mlx_sd"] == pytest.approx(1.0) == rows["mlx_sd"]["paired_speedup_vs_mlx_sd"]
    assert rep["mlx_sd_sweep"]["best_k"] in (2, 3, 4, 5, 6) and rows["mlx_sd"]["num_draft_tokens"] == [
        rep["mlx_sd_sweep"]["best_k"]]
    m = rows["mirror"]
    assert m["fallback_rate"] + m["reuse_rate"] == pytest.approx(1.0)
    assert 0 <= m["hidden_draft_fraction"] <= 1 and 0 <= m["omega_kappa"] <= 1
    assert m["mean_accepted"] >= 1
    assert set(m["breakdown_ms"]) == {"prefix", "suffix", "rollout_wait", "draft", "ring", "overhead", "draft_hidden",
                                      "ideal"}
    assert rows["sd"]["omega_kappa"] is None and rows["ar"]["breakdown_ms"].keys() == {"unsplit"}
    md = (out / "results.md").read_text()
    assert "| mirror [llama2xs (demo)] (" in md and "| mlx_sd [llama2xs (demo)] (k=" in md and "Latency per step" in md
    d = rep["decompose"]  # --decompose: each piece of a step timed alone, and Eq. 10 from them
    assert set(d["eq10"]) == {"mirror", "sd"} and all(v > 0 for v in d["eq10"].values())
    assert {"prefix", "suffix", "prepare", "rollout", "window", "verify", "sd_window"} <= set(d["pieces"])
    assert list(d["rollout_rows"]) == ["1", "2", "4", "8"] and "Eq. 10 from the pieces timed alone" in md
    p = d["pieces"]
    assert d["eq10"]["sd"] == pytest.approx(p["sd_window"] + p["verify"])
    reuse = m["reuse_rate"]
    assert d["eq10"]["mirror"] == pytest.approx(p["prefix"] + max(p["suffix"], max(0, p["prepare"] - p["prefix"])
                                                                  + p["rollout"]) + (1 - reuse) * p["window"])


def test_a_wrong_token_fails_the_run_and_names_the_prompt(tmp_path, monkeypatch):
    real = bench_mod.run_engine

    def broken(pipe, mode, p, index, *args, **kwargs):
        s = real(pipe, mode, p, index, *args, **kwargs)
        if mode == "sd" and index == 1:
            s.tokens[-1] = (s.tokens[-1] + 1) % 512
        return s

    monkeypatch.setattr(bench_mod, "run_engine", broken)
    out = tmp_path / "bad"
    r = CliRunner().invoke(main, SMOKE + ["--out", str(out)])
    assert r.exit_code == 1, r.output
    assert "sd differs from ar" in r.output and "prompt #1" in r.output and "token 15" in r.output
    rep = read(out)
    assert "prompt #1" in rep["error"] and not (out / "results.md").exists()
    assert {s["prompt"] for s in rep["samples"]} == {0, 1}  # what ran is kept for a look


def test_sampling_runs_without_the_equality_check(tmp_path):
    out = tmp_path / "t1"
    r = CliRunner().invoke(main, ["bench", "--limit", "1", "--max-tokens", "8", "--modes", "mirror,ar",
                                  "--temp", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    rep = read(out)
    assert rep["equality_checked"] is False and set(rep["summary"]["all"]) == {"mirror", "ar"}


def test_sweep_writes_table_and_heatmap(tmp_path):
    """Without the demo's layer-2 exit adapter, which fixes the exit layer."""
    out = tmp_path / "sw"
    r = CliRunner().invoke(main, ["bench", "--limit", "1", "--max-tokens", "8", "--sweep", "kappa=1,2 exit=1,N/2",
                                  "--gamma", "2", "--exit-adapter", "none", "--out", str(out)])
    assert r.exit_code == 0, r.output
    rep = read(out)
    names = {f"k{k}-g2-e{e}" for k in (1, 2) for e in (1, 2)}
    assert set(rep["summary"]["all"]) == names | {"ar"}
    assert rep["summary"]["all"]["ar"]["prompts"] == 2  # ar before and after the points, against drift
    assert rep["best"]["name"] in names and rep["equality_checked"]
    assert is_png(out / "sweep_heatmap.png")
    assert (out / "results.md").read_text().count("\n| ") == 5  # header + 4 points


def test_bad_modes_and_sweeps_are_usage_errors(tmp_path):
    r = CliRunner().invoke(main, ["bench", "--modes", "mirror,fast", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "fast" in r.output
    r = CliRunner().invoke(main, ["bench", "--sweep", "beta=1", "--limit", "1", "--out", str(tmp_path / "y")])
    assert r.exit_code == 2 and "beta=1" in r.output


def test_parsing():
    assert [layer_value(v, 15) for v in ("N/4", "N/2", "3N/4", "5", "N")] == [3, 7, 11, 5, 15]
    assert layer_value("N/8", 5) == 1  # never below layer 1
    assert parse_sweep("kappa=1,4,8,16 gamma=3,5,7 exit=N/4,N/2,3N/4", 15, 8, 7, 7) == {
        "kappa": [1, 4, 8, 16], "gamma": [3, 5, 7], "exit": [3, 7, 11]}
    assert parse_sweep("gamma=3", 15, 8, 7, 7) == {"kappa": [8], "gamma": [3], "exit": [7]}
    with pytest.raises(ValueError, match="exit layer"):
        layer_value("half", 15)
    assert parse_modes("ar, mirror") == ("ar", "mirror")
    with pytest.raises(ValueError):
        parse_modes("")


def test_summary_medians_rates_and_breakdown():
    def s(mode, tps, cat="a", fwd=10, **kw):
        return Sample(mode, 0, cat, [1] * 10, Stats(decode_seconds=10 / tps, target_forwards=fwd, peak_memory_gb=0.1,
                                                    **kw))

    step = {"prefix": (0.0, 0.1), "suffix": (0.1, 0.3), "rollout": (0.1, 0.35), "accepted": 1, "arrived": 0.36}
    fallback = dict(step, serial=(0.36, 0.43, 0.05))  # a serial window: 50 ms in the draft, 20 ms on the ring
    samples = [s("ar", 2.0), s("ar", 4.0), s("ar", 100.0, "b"),
               s("mirror", 6.0, fwd=4, steps=4, prefix_seconds=0.4, suffix_seconds=0.8, draft_seconds=1.2,
                 hidden_draft_seconds=0.8, reuses=3, fallbacks=1, omega_sum=2.0, timeline=[step] * 3 + [fallback])]
    rows = table(samples, ["mirror", "ar"])
    assert rows["all"]["ar"]["tokens_per_s"] == 4.0 and rows["a"]["ar"]["tokens_per_s"] == 3.0
    assert rows["all"]["mirror"]["speedup_vs_ar"] == pytest.approx(1.5)
    assert rows["all"]["mirror"]["speedup_vs_mlx_sd"] is None
    assert rows["all"]["ar"]["paired_speedup_vs_ar"] == 1.0 and rows["all"]["ar"]["paired_speedup_vs_mlx_sd"] is None
    m = summarize(samples[3:])
    assert m["mean_accepted"] == 2.5 and m["reuse_rate"] == 0.75 and m["omega_kappa"] == 0.5
    assert m["hidden_draft_fraction"] == pytest.approx(0.8 / 1.2)
    b = m["breakdown_ms"]  # per step (10/6 s over 4): rollouts outlast the suffix by 50 ms, 0.2 s of serial draft
    assert (b["prefix"], b["suffix"], b["rollout_wait"], b["draft"]) == pytest.approx((100, 200, 50, 50))
    assert b["ring"] == pytest.approx((4 * 10 + 20) / 4)  # 10 ms from each rollout's end to its arrival; 20 ms serial
    parts = ("prefix", "suffix", "rollout_wait", "draft", "ring", "overhead")
    assert sum(b[k] for k in parts) == pytest.approx(m["ms_per_step"])
    assert b["overhead"] == pytest.approx(1000 * (10 / 6 - 1.6) / 4 - 15)
    assert b["ideal"] == pytest.approx(100 + 250 + 50)  # Eq. 10: prefix + max(suffix 200, rollout 250) + serial


def test_paired_speedup_compares_each_prompt_with_its_own_ar():
    """A slow patch that hits one prompt's runs of every mode leaves the paired ratio alone."""
    def s(mode, prompt, tps):
        return Sample(mode, prompt, "a", [1] * 10, Stats(decode_seconds=10 / tps, target_forwards=10))

    samples = [s("ar", 0, 10.0), s("x", 0, 20.0), s("ar", 1, 2.0), s("x", 1, 4.0), s("ar", 2, 3.0), s("x", 2, 5.0),
               s("ar", 2, 5.0)]  # prompt 2: ar twice (a sweep times it at both ends), mean 4
    rows = table(samples, ["x", "ar"])["all"]
    assert rows["x"]["paired_speedup_vs_ar"] == pytest.approx(2.0)  # ratios 2, 2, 1.25
    assert rows["x"]["speedup_vs_ar"] == pytest.approx(5.0 / 4.0)  # ratio of medians: drift leaks in


def test_headline_names_each_rows_draft_and_compares_with_mlx_sds_best_over_drafts():
    from mirror_mlx.bench.headline import headline

    def run(draft: str, mlx_sd: float, mirror: float, split: bool) -> dict:
        rows = {m: dict(tokens_per_s=v, mean_accepted=2.0, paired_speedup_vs_mlx_sd=v / mlx_sd)
                for m, v in (("mirror", mirror), ("mlx_sd", mlx_sd), ("ar", 10.0))}
        ran = {"mirror": {"knobs": "mirror κ=1 γ=3 ℓe=3", "placement": "split" if split else "unpinned"},
               "mlx_sd": {"knobs": "k=4"}, "ar": {"knobs": ""}}
        return {"config": {"prompts": "tinystories", "temp": 0.0}, "draft": draft, "ran": ran,
                "summary": {"all": rows}, "machine": {"loadavg_start": [1.5, 1.0, 1.0]}}

    md = headline([("defaults", run("llama2xs-8M", 20.0, 25.0, True)), ("defaults", run("ss-8M", 25.0, 30.0, False))])
    lines = md.splitlines()[2:]
    assert len(lines) == 6  # mirror, mlx_sd and ar per draft's run
    mirror_plain = next(x for x in lines if "mirror [llama2xs-8M] (κ=1 γ=3 ℓe=3, cores split)" in x)
    assert "| 25.00 | 1.00 | 2.50 | 1.25 |" in mirror_plain  # against mlx_sd's best (the SS draft's 25), ar 10
    assert any("**mlx_sd [ss-8M] (k=4)** (best)" in x for x in lines)
    assert any("mirror [ss-8M] (κ=1 γ=3 ℓe=3) | 30.00 | 1.20 | 3.00 |" in x for x in lines)


@pytest.mark.parametrize("draft_vocab", [None, 64])
def test_mlx_sd_drives_an_ss_draft_with_the_head_the_host_runs(draft_vocab):
    """mlx_sd's copy of an SS draft folder, with draft_vocab or without: the host's head, whole or trimmed."""
    from types import SimpleNamespace

    import mlx.core as mx
    import numpy as np

    from mirror_mlx.demo import SS_DRAFT, TARGET
    from mirror_mlx.drafts.tokenizer import folder_tokenizer
    from mirror_mlx.pipeline import load_draft

    pipe = SimpleNamespace(draft=load_draft(SS_DRAFT, folder_tokenizer(TARGET), draft_vocab))
    logits = np.array(bench_mod.mlx_draft(pipe)(mx.array([[5, 61, 2]])))
    assert (~np.isneginf(logits)).sum(-1).max() == (draft_vocab or logits.shape[-1])


def test_smoke_on_spec_bench_eval_through_the_real_tokenizers_chat_template(smollm2, tmp_path):
    """`make bench`'s real-pair path at smoke size, on tiny random weights behind SmolLM2's tokenizer: one
    evaluation question per category, rendered through the chat template, every mode equal to mlx-lm's
    greedy tokens, and the headline's per-category tables with the cost line under them."""
    import shutil

    from mirror_mlx.bench.headline import document
    from mirror_mlx.prompts import load_prompts
    from tests.models import save_tiny_model

    pair = {}
    for name, layers in (("target", 4), ("draft", 2)):
        pair[name] = save_tiny_model(tmp_path / name, "llama_tied", seed=len(name), vocab_size=49152,
                                     num_hidden_layers=layers)
        for f in smollm2.iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                shutil.copy(f, pair[name] / f.name)
    out = tmp_path / "b"
    bench_mod.bench(bench_mod.BenchConfig(model=str(pair["target"]), draft_model=str(pair["draft"]),
                                          prompts="spec_bench_eval", limit=13, max_tokens=3, out=out,
                                          modes=["mirror", "mlx_sd", "ar"], sd_ks=(2, 3), warmup_tokens=2,
                                          progress=False))
    rep = read(out)
    held = load_prompts("spec_bench_eval")
    assert rep["equality_checked"] and "error" not in rep
    assert [p["text"] for p in rep["prompts"]] == [p.text for p in load_prompts("spec_bench_eval", 13)]
    assert {p["text"] for p in rep["prompts"]} <= {p.text for p in held} and len(rep["summary"]) == 14
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pair["target"]))
    first = tok.apply_chat_template([{"role": "user", "content": held[0].text}], add_generation_prompt=True,
                                    tokenize=False)
    assert rep["prompts"][0]["tokens"] == len(tok.encode(first))  # templated, not the bare question
    md = document([("defaults", rep)], {"defaults": "draft 1-row forward 1.0 ms / target 1-row forward 2.0 ms"})
    assert md.count("Cost structure (defaults): draft 1-row forward") == 14
    assert "### Category: rag" in md and "| **mlx_sd [draft] (k=" in md and "| mirror [draft] (" in md
