"""The installed package type-checks (mypy) and lints clean (ruff), both configured in pyproject.toml."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# mypy's errors left in the package: the ceiling only comes down (0: every module type-checks)
MYPY_ERRORS = 32


@pytest.mark.timeout(600)
def test_mypy_finds_no_more_errors_than_the_ceiling(tmp_path):
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
    found = re.search(r"Found (\d+) errors?", out.stdout)
    errors = int(found.group(1)) if found else 0
    assert found or out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]
    assert errors <= MYPY_ERRORS, out.stdout[-8000:]


def test_ruff_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]
