"""Build mirror_mlx/data/code_edit.jsonl: HumanEval solutions to be repeated with one identifier renamed.

Each row is a chat prompt: a HumanEval function (its `prompt` + `canonical_solution`) and the request to
rewrite it with its first parameter renamed; the answer copies the function almost verbatim, the case
prompt lookup is for. The first 16 HumanEval tasks (by id) whose function is at most 700 characters and
whose first parameter is at least 2 characters long; the new name is `input_` + the old one. `expected`
is the function with the name replaced token by token (Python's tokenize), for reference; nothing checks
a model's answer against it.

    python scripts/make_code_edit.py /path/to/HumanEval.jsonl.gz [--out mirror_mlx/data/code_edit.jsonl]

HumanEval: openai/human-eval, data/HumanEval.jsonl.gz, MIT (mirror_mlx/data/human-eval_LICENSE.txt).
"""

import argparse
import ast
import gzip
import io
import json
import tokenize
from pathlib import Path

N, MAX_CHARS = 16, 700


def rename(code: str, old: str, new: str) -> str:
    """`code` with every NAME token `old` replaced by `new` (strings and comments untouched, layout kept)."""
    lines = code.splitlines(keepends=True)
    at = [t.start for t in tokenize.generate_tokens(io.StringIO(code).readline)
          if t.type == tokenize.NAME and t.string == old]
    for row, col in reversed(at):
        line = lines[row - 1]
        lines[row - 1] = line[:col] + new + line[col + len(old):]
    return "".join(lines)


def first_param(code: str, entry_point: str) -> str | None:
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.FunctionDef) and node.name == entry_point and node.args.args:
            return node.args.args[0].arg
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("humaneval")
    ap.add_argument("--out", default="mirror_mlx/data/code_edit.jsonl")
    args = ap.parse_args()
    rows = [json.loads(line) for line in gzip.open(args.humaneval, "rt", encoding="utf-8")]
    out = []
    for r in rows:
        code = r["prompt"] + r["canonical_solution"]
        old = first_param(code, r["entry_point"])
        if len(code) > MAX_CHARS or not old or len(old) < 2:
            continue
        new = "input_" + old
        prompt = (f"Here is a Python function:\n\n```python\n{code.strip()}\n```\n\n"
                  f"Rewrite it with the variable `{old}` renamed to `{new}`. Reply with the whole function only.")
        out.append({"task_id": r["task_id"], "category": "code_edit", "old": old, "new": new, "prompt": prompt,
                    "expected": rename(code, old, new).strip()})
        if len(out) == N:
            break
    Path(args.out).write_text("".join(json.dumps(o) + "\n" for o in out), encoding="utf-8")
    print(f"wrote {len(out)} rows to {args.out}: {', '.join(o['task_id'] for o in out)}")


if __name__ == "__main__":
    main()
