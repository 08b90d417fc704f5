"""Questions a chat target writes itself, for its distillation data (Magpie, arXiv 2406.08464).

The chat template up to the opening of a user turn, sampled on at T = 1: what the model writes before its end of
turn is a user message drawn from what it was tuned on. The replies to a few hundred fixed prompts stop adding
agreement once each prompt has a few (docs/distill.md); these add prompts, as many as there is time to sample.
They are kept as text, one JSON object a line ({"seed": s, "text": ...}), so a repository holds them and any
machine goes on from the last seed (`distill questions`), and `distill data --questions` replies to them.
"""

import json
from pathlib import Path
from typing import Callable, Iterable

import mlx.nn as nn

from mirror_mlx.corpus import eos_ids

from .distill_data import batched_replies, read_questions, render

MARK = "\u2063QUESTION\u2063"  # a user message no tokenizer merges with the text around it
SHORTEST, LONGEST = 8, 1200  # characters: shorter or longer texts are no question a user would ask


def user_turn_prefix(tokenizer) -> list[int]:
    """The chat template's ids up to where a user message's text begins (its system prompt included)."""
    if not (getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None)):
        raise ValueError("the tokenizer has no chat template: questions are sampled from the opening of a user "
                         "turn, so use a chat (instruct) model")
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False)
    prefix = list(tokenizer.encode(text[: text.index(MARK)], add_special_tokens=False))
    if render(tokenizer, MARK)[: len(prefix)] != prefix:
        raise ValueError("the chat template's text before a user message does not tokenize as the rendered "
                         "prompt begins: this template cannot be sampled for questions")
    return prefix


def write_questions(model: nn.Module, tokenizer, path: Path, count: int, batch_size: int = 64, max_tokens: int = 96,
                    exclude: Iterable[str] = (), log: Callable[[str], None] = print) -> dict:
    """Sample questions into `path` until it holds `count`, going on from its last seed. A sample is kept when
    it ended its turn within `max_tokens`, is SHORTEST to LONGEST characters, and is new (nor in `exclude`: the
    evaluation part's questions). Returns counts."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"{path}: its folder does not exist: give a path in an existing folder")
    have = read_questions(path)
    seen = {q["text"] for q in have} | set(exclude)
    seed = max((q["seed"] for q in have), default=-1) + 1
    prefix, eos = user_turn_prefix(tokenizer), eos_ids(tokenizer)
    kept = tried = 0
    with open(path, "a") as out:
        while len(have) + kept < count:
            seeds = list(range(seed, seed + batch_size))
            seed += batch_size
            for s, r in zip(seeds, batched_replies(model, [prefix], [[(1.0, s) for s in seeds]], max_tokens, eos)[0]):
                tried += 1
                ended = len(r.reply) and int(r.reply[-1]) in eos
                text = tokenizer.decode([int(t) for t in r.reply[:-1]]).strip() if ended else ""
                if ended and SHORTEST <= len(text) <= LONGEST and text not in seen and len(have) + kept < count:
                    seen.add(text)
                    out.write(json.dumps({"seed": s, "text": text}, ensure_ascii=False) + "\n")
                    kept += 1
            out.flush()
            log(f"distill questions: {len(have) + kept} of {count} ({kept} of {tried} samples kept)")
    return {"questions": len(have) + kept, "kept": kept, "tried": tried}
