"""Every terminal transcript in README.md and docs/*.md (a code block that starts with `$ `) is what the command
prints today: each is run (a `>>` session in a real terminal, a pty, so the prompt and the dim stats show as a user
sees them) and its output compared line by line, numbers aside (they are one run's). Under `--mode auto` the mode
is this machine's choice, so only its place is compared: every form `Stats.summary` can print for a choice of auto's
stands for it. The Python API example of docs/chat.md likewise."""

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mirror_mlx.options import MODES
from mirror_mlx.engine.stats import Stats

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def auto_choices() -> re.Pattern:
    """What `Stats.summary` prints from "mode" on for each mode auto can choose: the mode, its knobs, auto's reason
    and the fields only that mode has (mirror's fallback, reuse, hidden draft, split cores), numbers as \\d+."""
    forms = set()
    for mode in MODES:
        for placement in ("", "split: the draft on its own core"):
            line = Stats(mode=mode, kappa=1, gamma=1, exit_layer=1, why="auto: WHY", placement=placement).summary()
            line = line[line.index("| mode ") + 2:]
            forms.add(re.sub(r"\d+", r"\\d+", re.escape(line)).replace("WHY", r"[^|]*"))
    return re.compile("|".join(sorted(forms, key=len, reverse=True)))


AUTO = auto_choices()


def code_blocks(path: Path) -> list[list[str]]:
    blocks, current = [], None
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


TRANSCRIPTS = {f"{path.relative_to(ROOT)}:{i}": block for path in DOCS
               for i, block in enumerate(code_blocks(path)) if block and block[0].startswith("$ ")}


def shape(lines: list[str]) -> list[str]:
    """The lines with the numbers blanked; auto's mode and reason (and the mirror-only fields after them) as one mark."""
    out = []
    for line in lines:
        line = ESCAPES.sub("", line).rstrip()
        line = AUTO.sub("mode <auto's choice>", line)
        out.append(re.sub(r"\d+(?:\.\d+)?", "#", line))
    while out and out[-1] in ("", "$"):
        out.pop()
    return out


def environment(tmp_path: Path) -> dict:
    """The command's environment: its own Hugging Face home, the session's tuning cache (conftest.py: auto
    calibrates the demo pair once, and the transcripts' shapes hold for whatever it chose)."""
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                HF_HOME=str(tmp_path / "hf"), COLUMNS="200", TERM="xterm")


def command_of(line: str) -> str:
    return line[2:].split("  # ")[0].strip()


def in_a_terminal(command: str, inputs: list[str], env: dict, timeout: float = 240) -> list[str]:
    """Run `command` in a pty, typing each input at its `>> ` prompt; everything it printed, as lines."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the command, in the repository
        os.chdir(ROOT)
        os.execvpe("bash", ["bash", "-c", command], env)
    out, end = b"", time.time() + timeout

    def read(until) -> bool:
        nonlocal out
        while time.time() < end:
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    data = os.read(fd, 4096)
                except OSError:  # the child closed the terminal
                    return False
                if not data:
                    return False
                out += data
                if until(out):
                    return True
        return False

    try:
        for text in inputs:
            prompts = out.count(b">> ")
            assert read(lambda o: o.count(b">> ") > prompts), out.decode(errors="replace")
            os.write(fd, text.encode() + b"\n")
        read(lambda o: False)  # to the end (the last input quits)
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out.decode(errors="replace")
    return out.decode("utf-8", "replace").replace("\r\n", "\n").split("\n")


def test_the_transcripts_are_found():
    """Not vacuous: the chat sessions of README.md and docs/chat.md, the pipe and the offline example."""
    assert {"README.md", "docs/chat.md"} <= {name.split(":")[0] for name in TRANSCRIPTS}
    assert sum(1 for block in TRANSCRIPTS.values() for line in block if line.startswith("$ ")) >= 5


@pytest.mark.parametrize("name", list(TRANSCRIPTS))
def test_a_transcript_is_what_the_command_prints(name, tmp_path):
    block = TRANSCRIPTS[name]
    env = environment(tmp_path)
    if any(line.startswith(">> ") for line in block):  # an interactive session: one command, typed inputs
        inputs = [line[3:] for line in block if line.startswith(">> ")]
        printed = in_a_terminal(command_of(block[0]), inputs, env)
        assert shape(printed) == shape(block[1:])
        return
    starts = [i for i, line in enumerate(block) if line.startswith("$ ")] + [len(block)]
    for start, stop in zip(starts, starts[1:]):
        command = command_of(block[start])
        if not command:
            continue
        run = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        printed = (run.stdout + run.stderr).split("\n")
        assert shape(printed) == shape(block[start + 1 : stop]), command


def test_the_python_api_example_prints_its_documented_output(tmp_path):
    text = (ROOT / "docs" / "chat.md").read_text()
    api = text[text.index("## The Python API"):]
    code = api[api.index("```python\n") + len("```python\n"):]
    code = code[:code.index("```")]
    shown = api[api.index("Its output"):]
    shown = shown[shown.index("```\n") + 4:]
    shown = shown[:shown.index("```")]
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=environment(tmp_path), capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    assert shape(run.stdout.split("\n")) == shape(shown.split("\n"))
