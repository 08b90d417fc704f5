"""Every flag of mlx_lm.generate, mlx_lm.chat and mlx_lm.server is in docs/mlx-lm-flags.md, and the table is
true: a supported flag is an option of ours, a refused one stops with its reason, an `ours only` one is ours
and not mlx-lm's, and every option of ours is listed."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from mirror_mlx.cli import main
from mirror_mlx.cli.refused import ALIASES, REFUSED

TABLE = Path(__file__).resolve().parents[1] / "docs" / "mlx-lm-flags.md"
COMMANDS = {"generate": "generate", "chat": "chat", "serve": "server"}  # ours -> mlx-lm's


def mlx_lm_flags(command: str) -> set[str]:
    """The long and short flags mlx-lm's own `--help` lists (its argparse parser, run as a user runs it)."""
    out = subprocess.run([sys.executable, "-m", "mlx_lm", command, "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", out.stdout)) - {"-h", "--help"}


def table(command: str) -> dict[str, str]:
    """flag -> status from the section of docs/mlx-lm-flags.md for `mirror-mlx COMMAND`."""
    text = TABLE.read_text()
    section = text.split(f"## `mirror-mlx {command}`")[1].split("\n## ")[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] in ("supported", "refused", "ours only"):
            for flag in re.findall(r"`(--?[\w-]+)`", cells[0]):
                rows[flag] = cells[1]
    return rows


def our_options(command: str, hidden: bool) -> set[str]:
    cmd = main.get_command(None, command)
    return {o for p in cmd.params if hidden or not getattr(p, "hidden", False)
            for o in p.opts + p.secondary_opts} - {"-h", "--help"}


@pytest.fixture(scope="module", params=list(COMMANDS))
def command(request):
    return request.param, mlx_lm_flags(COMMANDS[request.param]), table(request.param)


def test_every_mlx_lm_flag_is_in_the_table(command):
    name, theirs, rows = command
    missing = sorted(theirs - set(rows))
    assert not missing, f"mlx_lm.{COMMANDS[name]} flags missing from docs/mlx-lm-flags.md ({name}): {missing}"


def test_supported_flags_are_options_of_ours(command):
    name, theirs, rows = command
    supported = {f for f, s in rows.items() if s == "supported"}
    assert supported <= theirs, f"listed as supported but not mlx-lm's: {sorted(supported - theirs)}"
    assert not supported - our_options(name, hidden=False), sorted(supported - our_options(name, hidden=False))


def test_refused_flags_stop_with_their_reason(command):
    name, theirs, rows = command
    refused = {f for f, s in rows.items() if s == "refused"}
    short = {alias: flag for flag, aliases in ALIASES.items() for alias in aliases}
    assert refused <= theirs and {short.get(f, f) for f in refused} == set(REFUSED[name])
    for flag in refused:
        takes_value, why = REFUSED[name][short.get(flag, flag)]
        result = CliRunner().invoke(main, [name, flag, *(["1"] if takes_value else [])])
        assert result.exit_code == 2, (flag, result.output)
        assert f"{short.get(flag, flag)} is refused: {why}" in result.output, result.output


def test_our_own_flags_are_listed_and_not_mlx_lm_s(command):
    name, theirs, rows = command
    ours_only = {f for f, s in rows.items() if s == "ours only"}
    assert not ours_only & theirs, sorted(ours_only & theirs)
    assert ours_only <= our_options(name, hidden=False)
    unlisted = sorted(our_options(name, hidden=False) - set(rows))
    assert not unlisted, f"options of mirror-mlx {name} missing from docs/mlx-lm-flags.md: {unlisted}"
