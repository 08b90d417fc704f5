"""Prompt sets for the benchmark, as (category, text) pairs in a fixed order.

`tinystories`: the held-out openings of the TinyStories corpus shipped in data/ (corpus.split: no
training text of the shipped SS draft or exit adapter begins with one; in domain for the demo
models); `spec_bench`, `mt_bench`: the first turn of each question, with its category (out of
domain for the demo models, reported anyway); `spec_bench_train`, `spec_bench_eval`: Spec-Bench's
two fixed parts (`spec_bench_part`): tuning and training of a chat model draw from the first, the
benchmark from the second; or any FILE.jsonl with a `prompt` or `turns` field.
A `limit` takes prompts round-robin over the categories, so a few prompts still cover all of them.
"""

import json
from pathlib import Path
from typing import NamedTuple, Optional

from .corpus import CORPUS, load_split

DATA = CORPUS.parent
SETS = {"tinystories": CORPUS.name, "spec_bench": "spec_bench_question.jsonl",
        "mt_bench": "mt_bench_question.jsonl", "spec_bench_train": "spec_bench_question.jsonl",
        "spec_bench_eval": "spec_bench_question.jsonl"}
EVAL_EVERY = 5  # question_id % 5 == 0: the evaluation part (a fifth of every category: 2 of 10, 16 of 80)


class Prompt(NamedTuple):
    category: str
    text: str


def tinystories(path: Path = CORPUS) -> list[Prompt]:
    """The corpus's held-out openings, in file order (corpus.split)."""
    return [Prompt("tinystories", text) for text in load_split(path).held_out]


def is_eval(question_id: int) -> bool:
    """Spec-Bench's evaluation part: question_id % 5 == 0. The ids run in blocks per category (81-160 the
    MT-Bench eight, then 80 each), so the rule takes a fixed fifth of every category; docs/spec-bench-split.md
    lists both parts. No tuning, draft training or adapter fitting may read the evaluation part."""
    return question_id % EVAL_EVERY == 0


def spec_bench_part(part: str, path: Optional[Path] = None) -> list[Prompt]:
    """`train` or `eval`: Spec-Bench's first turns in file order, split by `is_eval` on question_id."""
    if part not in ("train", "eval"):
        raise ValueError(f"unknown Spec-Bench part {part!r}: use train or eval")
    path = Path(path or DATA / SETS["spec_bench"])
    return [p for p, qid in zip(jsonl(path), question_ids(path)) if is_eval(qid) == (part == "eval")]


def question_ids(path: Path) -> list[int]:
    """Each line's question_id, in file order (blank lines skipped, as `jsonl` skips them)."""
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return [int(r["question_id"]) for r in rows]


def chat_calibration(n: int) -> list[Prompt]:
    """`n` prompts a chat model is tuned on: Spec-Bench's training part, round-robin over its categories."""
    return load_prompts("spec_bench_train", n)


def jsonl(path: Path, category: Optional[str] = None) -> list[Prompt]:
    """One prompt per line: its `prompt`, else the first of its `turns`; category from the row or `category`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file not found: {path} (give a .jsonl file or one of {', '.join(SETS)})")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not valid JSON ({e.msg})") from None
        text = row.get("prompt") if isinstance(row, dict) else None
        if text is None and isinstance(row, dict) and row.get("turns"):
            text = row["turns"][0]
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}:{n} has no 'prompt' string and no 'turns' list")
        out.append(Prompt(str(row.get("category") or category or path.stem), text))
    return out


def spread(prompts: list[Prompt], limit: Optional[int]) -> list[Prompt]:
    """At most `limit` prompts, taken round-robin over categories in order of first appearance."""
    if limit is None or limit >= len(prompts):
        return list(prompts)
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    out, i = list[Prompt](), 0
    while len(out) < limit:
        out.extend(q[i] for q in by_cat.values() if i < len(q))
        i += 1
    return out[:limit]


def load_prompts(name: str, limit: Optional[int] = None) -> list[Prompt]:
    """`tinystories`, `spec_bench`, `spec_bench_train`, `spec_bench_eval`, `mt_bench`, or a .jsonl file."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1 (got {limit})")
    if name == "tinystories":
        prompts = tinystories()
    elif name.startswith("spec_bench_") and name in SETS:
        prompts = spec_bench_part(name.removeprefix("spec_bench_"))
    elif name in SETS:
        prompts = jsonl(DATA / SETS[name])
    elif name.endswith(".jsonl") or Path(name).is_file():
        prompts = jsonl(Path(name))
    else:
        raise ValueError(f"unknown prompt set {name!r}: use {', '.join(SETS)} or a FILE.jsonl")
    return spread(prompts, limit)
