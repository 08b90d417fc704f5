"""Prompt sets for the benchmark, as (category, text) pairs in a fixed order.

`tinystories`: the held-out openings of the TinyStories corpus shipped in data/ (corpus.split: no
training text of the shipped SS draft or exit adapter begins with one; in domain for the demo
models); `spec_bench`, `mt_bench`: the first turn of each question, with its category (out of
domain for the demo models, reported anyway); or any FILE.jsonl with a `prompt` or `turns` field.
A `limit` takes prompts round-robin over the categories, so a few prompts still cover all of them.
"""

import json
from pathlib import Path
from typing import NamedTuple, Optional

from .corpus import CORPUS, load_split

DATA = CORPUS.parent
SETS = {"tinystories": CORPUS.name, "spec_bench": "spec_bench_question.jsonl",
        "mt_bench": "mt_bench_question.jsonl"}


class Prompt(NamedTuple):
    category: str
    text: str


def tinystories(path: Path = CORPUS) -> list[Prompt]:
    """The corpus's held-out openings, in file order (corpus.split)."""
    return [Prompt("tinystories", text) for text in load_split(path).held_out]


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
    out, i = [], 0
    while len(out) < limit:
        out.extend(q[i] for q in by_cat.values() if i < len(q))
        i += 1
    return out[:limit]


def load_prompts(name: str, limit: Optional[int] = None) -> list[Prompt]:
    """`tinystories`, `spec_bench`, `mt_bench`, or a path to a .jsonl file."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1 (got {limit})")
    if name == "tinystories":
        prompts = tinystories()
    elif name in SETS:
        prompts = jsonl(DATA / SETS[name])
    elif name.endswith(".jsonl") or Path(name).is_file():
        prompts = jsonl(Path(name))
    else:
        raise ValueError(f"unknown prompt set {name!r}: use {', '.join(SETS)} or a FILE.jsonl")
    return spread(prompts, limit)
