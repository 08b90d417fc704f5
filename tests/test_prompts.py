"""Prompt sets: fixed order, right categories, limits that cover every category."""

import json

import pytest

from mirror_mlx.corpus import opening
from mirror_mlx.prompts import DATA, Prompt, load_prompts


def test_opening_is_first_sentence_or_first_words():
    assert opening("One day, Daisy saw a dog. The dog was big.") == "One day, Daisy saw a dog."
    assert opening("Once upon a time, in a big forest, there lived a fox.") == "Once upon a time, in a big forest,"
    assert opening('"Help!" said Tom. He ran.') == '"Help!"'
    assert opening("No full stop at all here") == "No full stop at all here"
    assert opening("Roxy was sad.\nShe cried.") == "Roxy was sad."


def test_tinystories_openings():
    ps = load_prompts("tinystories")
    assert ps == load_prompts("tinystories")  # deterministic
    assert len(ps) > 150 and len({p.text for p in ps}) == len(ps)  # the held-out side (tests/test_corpus.py)
    assert all(isinstance(p, Prompt) and p.category == "tinystories" for p in ps)
    assert all(4 <= len(p.text.split()) <= 8 for p in ps)
    assert ps[0].text == "After playing with the car, Kitty and Spot"  # the file opens mid-story with "Spot."
    paragraphs = [" ".join(q.split()) for q in (DATA / "tinystories_train.txt").read_text().split("\n\n")]
    assert all(any(q.startswith(p.text) for q in paragraphs) for p in ps[:50])
    assert load_prompts("tinystories", limit=5) == ps[:5]


def test_spec_bench_first_turns_with_categories():
    ps = load_prompts("spec_bench")
    rows = [json.loads(line) for line in (DATA / "spec_bench_question.jsonl").read_text().splitlines()]
    assert ps == [(r["category"], r["turns"][0]) for r in rows]
    some = load_prompts("spec_bench", limit=13)
    assert len({p.category for p in some}) == 13  # one of each category, not 13 "writing" prompts
    assert "translation" in {p.category for p in some}


def test_mt_bench_limit_round_robin():
    ps = load_prompts("mt_bench")
    assert len(ps) == 80 and len({p.category for p in ps}) == 8
    assert [p.category for p in load_prompts("mt_bench", limit=3)] == ["writing", "roleplay", "reasoning"]
    nine = load_prompts("mt_bench", limit=9)
    assert nine[8].category == "writing" and nine[8] != nine[0]


def test_jsonl_file(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "Hello there"}\n\n{"turns": ["First", "Second"], "category": "chat"}\n')
    assert load_prompts(str(f)) == [("mine", "Hello there"), ("chat", "First")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_prompts(str(bad))
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_prompts(str(bad))


@pytest.mark.parametrize("name,limit,words", [
    ("nope", None, "unknown prompt set"), ("missing.jsonl", None, "not found"), ("mt_bench", 0, "at least 1")])
def test_errors(name, limit, words):
    with pytest.raises(ValueError, match=words):
        load_prompts(name, limit)


def test_spec_bench_split_is_fixed_disjoint_and_stratified():
    """question_id % 5 == 0 is the evaluation part: a fifth of every category, never a training prompt."""
    from collections import Counter

    from mirror_mlx.prompts import question_ids, spec_bench_part

    train, held = spec_bench_part("train"), spec_bench_part("eval")
    ids = question_ids(DATA / "spec_bench_question.jsonl")
    assert len(train) + len(held) == len(ids) == 480 and not {p.text for p in train} & {p.text for p in held}
    every = Counter(p.category for p in load_prompts("spec_bench"))
    assert Counter(p.category for p in held) == {c: n // 5 for c, n in every.items()}
    assert load_prompts("spec_bench_eval") == held and load_prompts("spec_bench_train") == train
    assert sorted(i for i in ids if i % 5 == 0)[:3] == [85, 90, 95]
    with pytest.raises(ValueError, match="unknown Spec-Bench part"):
        spec_bench_part("test")


def test_a_chat_model_tunes_on_the_training_part_only():
    from mirror_mlx.tune.traces import calibration_prompts

    class Chat:  # calibration_prompts only encodes: keep the text
        tokenizer = type("T", (), {"has_chat_template": True})()
        encode = staticmethod(lambda text: text)

    calibration = calibration_prompts(Chat(), 20)
    held = {p.text for p in load_prompts("spec_bench_eval")}
    assert len(calibration) == 20 and not set(calibration) & held
    assert set(calibration) <= {p.text for p in load_prompts("spec_bench_train")}
