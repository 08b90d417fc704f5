"""Every file the docs name exists: the links of README.md, BENCHMARKS.md and docs/*.md (relative to the page),
and each `path/in/backticks` that starts at one of the repository's top folders."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]


def top_folders() -> tuple[str, ...]:
    """The repository's own top folders (what git tracks: not build/ or a virtualenv a checkout may hold)."""
    import subprocess

    try:
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):  # not a checkout: every folder but the ones builds make
        return tuple(f"{p.name}/" for p in ROOT.iterdir() if p.is_dir() and p.name not in ("build", "bench_out"))
    return tuple(sorted({f.split("/")[0] + "/" for f in files.splitlines() if "/" in f}))


TOP = top_folders()
LINK = re.compile(r"\]\(([^)\s]+)\)")
TICKED = re.compile(r"`([A-Za-z0-9_.\-/]+)`")


def named(page: Path) -> list[tuple[str, Path]]:
    """(as written, where it points) for each link and each repository path in backticks on the page."""
    text = page.read_text(encoding="utf-8")
    out = []
    for target in LINK.findall(text):
        target = target.split("#")[0]
        if target and "://" not in target and not target.startswith("mailto:"):
            out.append((target, page.parent / target))
    for path in TICKED.findall(text):
        if path.startswith(TOP) and "/" in path.rstrip("/") and "*" not in path:
            out.append((path, ROOT / path))
    return out


def test_the_docs_name_files_at_all():
    """Not vacuous: the pages link to each other and name modules."""
    names = [n for page in PAGES for n, _ in named(page)]
    assert "docs/design.md" in names and sum(n.startswith("mirror_mlx/") for n in names) >= 5


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_page_names_exists(page):
    missing = [name for name, path in named(page) if not path.exists()]
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"


@pytest.mark.parametrize("page", ["README.md", "BENCHMARKS.md"])
def test_the_front_pages_read_in_minutes(page):
    """The README and BENCHMARKS stay short (≤ 250 lines): reference goes to docs/, older tables to docs/bench/."""
    assert len((ROOT / page).read_text(encoding="utf-8").splitlines()) <= 250
