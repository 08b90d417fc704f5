"""The distilled draft (mirror_mlx/train/distill.py, drafts/distilled/model.py) on the tiny demo target: data →
train → save → load as a draft, resumption after an interrupted run, and the kept-ids mapping."""

import json
from pathlib import Path

import numpy as np
import pytest

import mirror_mlx  # noqa: F401  (OpenBLAS first)
import mlx.core as mx
from mlx_lm.utils import load

from mirror_mlx.train import distill, distill_data
from mirror_mlx.demo import TARGET
from mirror_mlx.drafts.distilled.model import MODEL_TYPE
from mirror_mlx.prompts import spec_bench_part
from mirror_mlx.train.questions import read_questions, user_turn_prefix, write_questions


def is_distilled(folder: Path) -> bool:
    config = Path(folder) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == MODEL_TYPE


PROMPTS = {"eval": ["Once upon a time", "The cat sat"],
           "spec_bench": ["Tom and Lily went to", "One day a little bird", "The sun was", "Sam had a red ball"],
           "code_edit": ["Mia liked to draw pictures of"]}


@pytest.fixture(scope="module")
def target():
    return load(str(TARGET))


def data_cfg(tmp: Path, **kw) -> distill.DataConfig:
    return distill.DataConfig(target=str(TARGET), data_dir=str(tmp), max_tokens=12, batch_size=6, rounds=1,
                              prompts=PROMPTS, **kw)


def train_cfg(tmp: Path, out: str, **kw) -> distill.TrainConfig:
    settings = dict(frozen=2, trained=1, kept=48, epochs=2, lr=1e-3, batch_tokens=128)
    return distill.TrainConfig(target=str(TARGET), out=str(tmp / out), data_dir=str(tmp / "data"),
                               run_dir=str(tmp / ("run-" + out)), **{**settings, **kw})


def files(d: Path) -> dict:
    return {p.name: {k: v.tolist() for k, v in np.load(p).items()} for p in sorted((d / "replies").glob("*.npz")) if not p.name.endswith(".tmp.npz")}


def test_data_resumes_to_the_same_replies(tmp_path, target):
    model, tok = target
    whole = distill.generate_data(data_cfg(tmp_path / "whole"), progress=False, log=lambda s: None,
                                  model=model, tokenizer=tok)
    n_jobs = 2 + 4 * 5 + 1 * 5  # eval greedy; per training prompt: round 0 (3) + round 1 (2)
    assert whole["made"] == n_jobs and not whole["stopped"]
    # a run stopped after its first batch (as a killed one: what it saved stays), then run again
    part = distill.generate_data(data_cfg(tmp_path / "part"), progress=False, log=lambda s: None, stop_after_s=0,
                                 model=model, tokenizer=tok)
    assert part["stopped"] and 0 < part["made"] < n_jobs
    (tmp_path / "part" / "replies" / "junk.tmp.npz").write_bytes(b"half a file")  # a write cut short: ignored
    rest = distill.generate_data(data_cfg(tmp_path / "part"), progress=False, log=lambda s: None,
                                 model=model, tokenizer=tok)
    assert part["made"] + rest["made"] == n_jobs
    assert files(tmp_path / "whole") == files(tmp_path / "part")
    r = distill.read_replies(tmp_path / "whole", ("spec_bench",))
    assert len(r) == 4 * 5 and all(len(x.reply) == len(x.top_ids) == len(x.top_logits) for x in r)
    greedy = [x for x in r[:4]]  # greedy replies come first, and the top-1 logit is the greedy token
    assert all((x.top_ids[:, 0] == x.reply).all() for x in greedy)


def test_replies_kept_as_ids_restore_with_the_teacher_logits_recomputed(tmp_path, target):
    """Token ids are what a repository keeps: packed, then restored on another machine by batched prefill, each
    reply's file holds the same ids and the same teacher top-K (the greedy token first) as the one generated."""
    model, tok = target
    distill.generate_data(data_cfg(tmp_path / "made"), progress=False, log=lambda s: None, model=model, tokenizer=tok)
    packed = distill_data.pack_ids(tmp_path / "made", tmp_path / "ids.npz")
    made = files(tmp_path / "made")
    assert packed["replies"] == len(made) and packed["prompts"] == 2 + 4 + 1
    assert packed["bytes"] < 4 * packed["reply_tokens"] + 4096  # ids only: no logits
    got = distill_data.restore_ids(tmp_path / "ids.npz", tmp_path / "restored", model, batch_tokens=64,
                                   log=lambda s: None, progress=False)
    assert got["restored"] == len(made) and got["tokens_per_s"] > 0
    restored = files(tmp_path / "restored")
    assert restored.keys() == made.keys()
    for name, a in made.items():
        b = restored[name]
        assert b["prompt"] == a["prompt"] and b["reply"] == a["reply"]
        logits = np.array(a["top_logits"])
        clear = logits[:, 0] > logits[:, 1]  # where no two ids tie for first (in float16)
        assert (np.array(b["top_ids"])[clear, 0] == np.array(a["top_ids"])[clear, 0]).all()
        assert np.allclose(np.array(b["top_logits"])[:, :4], logits[:, :4], atol=0.05)
    again = distill_data.restore_ids(tmp_path / "ids.npz", tmp_path / "restored", model, log=lambda s: None,
                                     progress=False)
    assert again["restored"] == 0  # resumable: only what is missing


def test_a_new_machine_goes_on_past_the_packed_ids_and_the_file_only_grows(tmp_path, target):
    """A machine with only the repository's ids file generates what the file lacks (not what it holds), and
    packing its cache into the same file keeps the replies that came from the first machine."""
    model, tok = target
    first = distill.generate_data(data_cfg(tmp_path / "first"), progress=False, log=lambda s: None, stop_after_s=0,
                                  model=model, tokenizer=tok)
    ids = tmp_path / "ids.npz"
    distill_data.pack_ids(tmp_path / "first", ids)
    second = distill.generate_data(data_cfg(tmp_path / "second", ids=str(ids)), progress=False, log=lambda s: None,
                                   model=model, tokenizer=tok)
    whole = distill.generate_data(data_cfg(tmp_path / "whole"), progress=False, log=lambda s: None,
                                  model=model, tokenizer=tok)
    assert first["made"] + second["made"] == whole["made"]
    assert not set(files(tmp_path / "first")) & set(files(tmp_path / "second"))
    grown = distill_data.pack_ids(tmp_path / "second", ids)
    assert grown["replies"] == whole["made"] and grown["kept_from_file"] == first["made"]
    everything = {k: (p.tolist(), r.tolist()) for k, p, r in distill_data.unpack_ids(ids)}
    made = files(tmp_path / "whole")
    assert everything == {name[:-4]: (a["prompt"], a["reply"]) for name, a in made.items()}


def test_greedy_batch_reply_matches_one_row(target):
    model, tok = target
    prompts = [distill_data.render(tok, t) for t in ("Once upon a time there was", "Hi")]
    eos = [tok.eos_token_id]
    both = distill_data.batched_replies(model, prompts, [[(0.0, 0)], [(0.0, 0)]], 10, eos)
    alone = distill_data.batched_replies(model, prompts[1:], [[(0.0, 0)]], 10, eos)
    assert both[1][0].reply.tolist() == alone[0][0].reply.tolist()  # left padding changes nothing


def test_kept_ids_by_frequency():
    R = distill.Reply
    z = np.zeros((0, 1))
    replies = [R(np.array([1]), np.array([5, 5, 7, 9, 9, 9]), z, z), R(np.array([1]), np.array([7, 3]), z, z)]
    assert distill.kept_ids_by_frequency(replies, 2).tolist() == [5, 9]  # 9 x3, then 5 and 7 x2: 5 (lower id)
    assert distill.kept_ids_by_frequency(replies, 3, always=[2]).tolist() == [2, 5, 9]


def test_train_save_load_resume_and_real_ids(tmp_path, target):
    model, tok = target
    distill.generate_data(data_cfg(tmp_path / "data"), progress=False, log=lambda s: None, model=model, tokenizer=tok)
    quiet = dict(progress=False, log=lambda s: None, model=model, tokenizer=tok)
    whole = distill.train(train_cfg(tmp_path, "whole"), **quiet)
    assert whole["steps"] == whole["total"] > 2 and not whole["stopped"]
    # interrupted after 2 steps (checkpoint), then resumed: the same weights as the uninterrupted run
    cut = distill.train(train_cfg(tmp_path, "cut"), stop_after_steps=2, **quiet)
    assert cut["stopped"] and cut["steps"] == 2
    done = distill.train(train_cfg(tmp_path, "cut"), **quiet)
    assert done["steps"] == whole["steps"]
    a, b = mx.load(str(tmp_path / "whole" / "model.safetensors")), mx.load(str(tmp_path / "cut" / "model.safetensors"))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert done["agreement"] == whole["agreement"]
    again = distill.train(train_cfg(tmp_path, "cut"), **quiet)  # a finished run: its result, no more steps
    assert again["steps"] == done["steps"] and again["agreement"] == done["agreement"]

    # the folder loads through mlx-lm by its model_type, and as the pipeline's plain draft
    folder = tmp_path / "whole"
    assert is_distilled(folder) and json.loads((folder / "config.json").read_text())["model_type"] == MODEL_TYPE
    from mirror_mlx.drafts.recipes import mlx_draft
    from mirror_mlx.loading import load_model

    draft, dtok = load_model(folder)
    kept = np.array(draft.kept_ids)
    assert len(kept) == 48 and (np.diff(kept) > 0).all()
    x = mx.array([distill_data.render(tok, "Once upon a time")])
    full = draft(x)
    assert full.shape[-1] == 512  # logits over the whole vocabulary
    small = draft.kept_logits(x)
    # the full logits hold the kept logits at the kept ids and -inf elsewhere
    assert mx.allclose(full[..., mx.array(kept)], small).item()
    off = np.setdiff1d(np.arange(512), kept)
    assert bool(mx.all(full[..., mx.array(off)] == -mx.inf).item())
    # argmax over the full logits is the kept id of the argmax over the kept rows: a real vocabulary id
    assert (np.array(mx.argmax(full, -1)) == kept[np.array(mx.argmax(small, -1))]).all()
    rollout = mlx_draft(folder).rollout(x[0].tolist()[:-1], [x[0].tolist()[-1:]], 5)
    assert all(t in set(kept.tolist()) for t in rollout.windows[0])
    # agreement measured on the eval replies only counts real ids
    ev = distill.read_replies(tmp_path / "data", ("eval",))
    assert 0 <= distill.agreement(draft, ev)["agreement"] <= 1
    # by category: each evaluation reply under its prompt's Spec-Bench category, the parts adding up to the whole
    by = distill.agreement_by_category(draft, tmp_path / "data")
    assert set(by["by_category"]) == {p.category for p in spec_bench_part("eval")[:2]} and by["eval_replies"] == 2
    parts = by["by_category"].values()
    assert sum(c["positions"] for c in parts) == by["positions"] == distill.agreement(draft, ev)["positions"]
    assert sum(c["agreement"] * c["positions"] for c in parts) / by["positions"] == pytest.approx(by["agreement"])


def test_distilled_draft_is_lossless_in_the_pipeline(tmp_path, target):
    model, tok = target
    distill.generate_data(data_cfg(tmp_path / "data"), progress=False, log=lambda s: None, model=model, tokenizer=tok)
    distill.train(train_cfg(tmp_path, "d", epochs=1), progress=False, log=lambda s: None, model=model, tokenizer=tok)
    pipe = mirror_mlx.load(str(TARGET), str(tmp_path / "d"))
    try:
        ar = pipe.generate("Once upon a time", max_tokens=24, mode="ar").text
        sd = pipe.generate("Once upon a time", max_tokens=24, mode="sd", gamma=3).text
    finally:
        pipe.close()
    assert sd == ar


def test_loop_generates_then_trains_and_resumes(tmp_path, monkeypatch, target):
    model, tok = target
    monkeypatch.setattr("mirror_mlx.train.distill.load", lambda path: (model, tok))
    quiet = dict(progress=False, log=lambda s: None)
    data = data_cfg(tmp_path / "data")
    cfg = train_cfg(tmp_path, "drafts", epochs=1)
    # the first turn stops generating at once (as if killed while generating): a round needs new tokens
    distill.generate_data(data, stop_after_s=0, model=model, tokenizer=tok, **quiet)
    distill.loop(data, [cfg], generate_minutes=10, min_new_tokens=1, **quiet)
    state = json.loads((tmp_path / "data" / "loop.json").read_text())
    assert state["round"] == 1 and state["trained_tokens"] > 0
    latest = tmp_path / "drafts" / "latest-E2k1V48"
    assert latest.resolve() == (tmp_path / "drafts" / "round-000-E2k1V48").resolve() and is_distilled(latest)


def test_the_targets_own_questions_are_replied_to_as_the_source_self(tmp_path, target):
    model, tok = target
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"seed": s, "text": t}) + "\n" for s, t in ((0, "Where do owls sleep"),
                                                                                       (3, "Tell me about the sea"))))
    made = distill.generate_data(data_cfg(tmp_path / "data", questions=str(questions)), progress=False,
                                 log=lambda s: None, model=model, tokenizer=tok)
    assert made["made"] == 2 + 4 * 5 + 1 * 5 + 2 * 5  # the packaged sources' jobs, and 5 replies a question
    own = sorted(p.name for p in (tmp_path / "data" / "replies").glob("self-*.npz"))
    assert len(own) == 10 and own[0].startswith("self-00000-t0-s0-")
    first = distill_data.load_reply(tmp_path / "data" / "replies" / own[0])
    assert first.prompt.tolist() == distill_data.render(tok, "Where do owls sleep")
    with pytest.raises(ValueError, match="no chat template"):  # a base model writes no user turn
        write_questions(model, tok, tmp_path / "none.jsonl", 1)


def test_a_chat_target_writes_new_questions_and_goes_on_from_the_last_seed(smollm2, tmp_path):
    from mirror_mlx.loading import load_model

    model, tok = load_model(smollm2)
    quiet = dict(batch_size=4, max_tokens=48, log=lambda s: None)
    path = tmp_path / "q.jsonl"
    first = write_questions(model, tok, path, 2, **quiet)
    kept = read_questions(path)
    assert first["questions"] == 2 == len(kept)
    again = write_questions(model, tok, path, 3, **quiet)
    lines = read_questions(path)
    assert again["kept"] == 1 and lines[:2] == kept and lines[2]["seed"] > kept[1]["seed"]
    assert all(8 <= len(q["text"]) <= 1200 for q in lines) and len({q["text"] for q in lines}) == 3
    # an evaluation question is never kept: the first one excluded, the same seeds keep the others
    other = tmp_path / "other.jsonl"
    write_questions(model, tok, other, 2, exclude=[kept[0]["text"]], **quiet)
    assert [q["seed"] for q in read_questions(other)] == [q["seed"] for q in lines[1:]]
    prefix = user_turn_prefix(tok)  # the chat template up to a user message: system prompt, then the user's turn
    assert tok.decode(prefix).endswith("<|im_start|>user\n")


def test_a_questions_file_that_is_none_or_a_folder_that_is_missing_is_refused_in_one_sentence(tmp_path):
    from click.testing import CliRunner

    from mirror_mlx.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"seed": 0, "text": "fine"}\nnot json\n')
    r = CliRunner().invoke(main, ["distill", "data", "--model", str(TARGET), "--data-dir", str(tmp_path / "d"),
                                  "--questions", str(bad)])
    assert r.exit_code == 2 and "bad.jsonl line 2 is not a" in r.output and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(main, ["distill", "questions", "--model", str(TARGET), "--count", "1",
                                  "--out", str(tmp_path / "missing" / "q.jsonl")])
    assert r.exit_code == 2 and "its folder does not exist" in r.output and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("verb", ["data", "train", "measure", "loop", "pack", "restore"])
def test_a_model_that_is_no_model_folder_is_refused_in_one_sentence(tmp_path, verb):
    from click.testing import CliRunner

    from mirror_mlx.cli import main

    out = ["--out", str(tmp_path / "d")] if verb in ("train", "loop", "pack") else []
    if verb == "restore":
        (tmp_path / "ids.npz").write_bytes(b"")
        out = ["--ids", str(tmp_path / "ids.npz")]
    r = CliRunner().invoke(main, ["distill", verb, "--model", str(tmp_path / "none")] + out)
    assert r.exit_code == 2 and "is not an mlx-lm model folder (no config.json)" in r.output
    assert "Traceback" not in r.output
