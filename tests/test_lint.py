"""The installed package type-checks (mypy) and lints clean (ruff), both configured in pyproject.toml."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_mypy_finds_no_error(tmp_path):
    """mypy reads modules by their folders, so the package is laid out as pyproject.toml installs it
    (convert/ and ane_draft/ inside mirror_mlx/) in links under a temporary folder and checked from there."""
    package = tmp_path / "mirror_mlx"
    package.mkdir()
    for entry in (ROOT / "mirror_mlx").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for folder in ("convert", "ane_draft"):
        (package / folder).symlink_to(ROOT / folder)
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                          "--cache-dir", str(ROOT / ".mypy_cache"), "-p", "mirror_mlx"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=580)
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]


def test_no_blanket_ignores():
    """mypy is silenced line by line only: each `# type: ignore` names its error code and says why; the config
    skips only third-party modules (those that ship no types, and two large ones read as untyped)."""
    blanket = []
    for path in [*(ROOT / "mirror_mlx").rglob("*.py"), *(ROOT / "convert").rglob("*.py"),
                 *(ROOT / "ane_draft").rglob("*.py")]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "type: ignore" in line and not re.search(r"# type: ignore\[[a-z-, ]+\]  # \(.+\)", line):
                blanket.append(f"{path.relative_to(ROOT)}:{n}")
    assert not blanket, blanket
    config = (ROOT / "pyproject.toml").read_text()
    assert "ignore_errors" not in config and "disable_error_code" not in config


def test_ruff_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]
