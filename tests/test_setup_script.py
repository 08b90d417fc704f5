"""scripts/setup.sh picks a Python >= 3.10 (a stock Mac's python3 is 3.9) and says which, or says in one
line how to get one. Fake interpreters answer `--version` as the real ones do; no venv is created."""

import os
import subprocess
from pathlib import Path

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"
BASH = "/bin/bash"


def fake_python(folder: Path, name: str, answer: str, rc: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\necho '{answer}'\nexit {rc}\n")
    path.chmod(0o755)
    return path


def which_python(tmp_path: Path, path_dirs: list[Path], **env: str) -> subprocess.CompletedProcess:
    """`setup.sh --which-python` with only `path_dirs` on PATH (no uv, no Homebrew)."""
    full = {"PATH": os.pathsep.join(map(str, path_dirs)), "HOME": str(tmp_path),
            "HOMEBREW_PREFIX": str(tmp_path / "no-homebrew"), **env}
    return subprocess.run([BASH, str(SETUP), "--which-python"], env=full, capture_output=True, text=True, timeout=30)


def test_skips_a_python3_of_3_9_for_a_python3_12_later_on_path(tmp_path):
    fake_python(tmp_path / "system", "python3", "Python 3.9.6")
    py312 = fake_python(tmp_path / "brew", "python3.12", "Python 3.12.4")
    r = which_python(tmp_path, [tmp_path / "system", tmp_path / "brew"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(py312)
    assert r.stderr.strip() == f"setup: using Python 3.12.4 ({py312})"


def test_python3_wins_when_it_is_new_enough(tmp_path):
    py3 = fake_python(tmp_path / "a", "python3", "Python 3.11.9")
    fake_python(tmp_path / "b", "python3.13", "Python 3.13.0")
    r = which_python(tmp_path, [tmp_path / "a", tmp_path / "b"])
    assert (r.returncode, r.stdout.strip()) == (0, str(py3))


def test_a_broken_shim_is_skipped(tmp_path):
    # a pyenv shim of a version that is not installed prints an error and exits 127
    fake_python(tmp_path / "shims", "python3.13", "pyenv: python3.13: command not found", rc=127)
    fake_python(tmp_path / "shims", "python3", "Python 3.9.6")
    py310 = fake_python(tmp_path / "other", "python3.10", "Python 3.10.14")
    r = which_python(tmp_path, [tmp_path / "shims", tmp_path / "other"])
    assert (r.returncode, r.stdout.strip()) == (0, str(py310))


def fake_command(path: Path, test: str, answer) -> None:
    """A stand-in for a tool (uv, brew) that prints `answer` when its arguments pass the shell `test`."""
    path.write_text(f"#!/bin/sh\n[ {test} ] && echo {answer}\n")
    path.chmod(0o755)


def test_uv_managed_python_is_found(tmp_path):
    fake_python(tmp_path / "bin", "python3", "Python 3.9.6")
    managed = fake_python(tmp_path / "uv-python", "python3.12", "Python 3.12.8")
    fake_command(tmp_path / "bin" / "uv", '"$1 $2" = "python find"', managed)
    r = which_python(tmp_path, [tmp_path / "bin"])
    assert (r.returncode, r.stdout.strip()) == (0, str(managed))


def test_no_suitable_python_is_one_line_with_the_fix_and_a_nonzero_exit(tmp_path):
    py39 = fake_python(tmp_path / "system", "python3", "Python 3.9.6")
    r = which_python(tmp_path, [tmp_path / "system"])
    assert r.returncode == 1
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"setup: no Python >= 3.10 found (found {py39}: Python 3.9.6)")
    assert "brew install python@3.12" in lines[0] and "uv python install 3.12" in lines[0]


def test_python_env_var_too_old_is_refused_not_replaced(tmp_path):
    py39 = fake_python(tmp_path / "system", "python3", "Python 3.9.6")
    fake_python(tmp_path / "brew", "python3.12", "Python 3.12.4")
    r = which_python(tmp_path, [tmp_path / "system", tmp_path / "brew"], PYTHON=str(py39))
    assert r.returncode == 1
    assert r.stderr.strip().startswith(f"setup: PYTHON={py39} is Python 3.9.6; mirror-mlx needs Python >= 3.10")


def test_python_env_var_is_used_when_new_enough(tmp_path):
    py312 = fake_python(tmp_path / "brew", "python3.12", "Python 3.12.4")
    r = which_python(tmp_path, [tmp_path / "brew"], PYTHON=str(py312))
    assert r.returncode == 0
    assert r.stderr.strip() == f"setup: using Python 3.12.4 ({py312}, from PYTHON)"


def test_homebrew_python_is_found_through_brew(tmp_path):
    fake_python(tmp_path / "bin", "python3", "Python 3.9.6")
    py313 = fake_python(tmp_path / "homebrew" / "bin", "python3.13", "Python 3.13.1")
    fake_command(tmp_path / "bin" / "brew", '"$1" = "--prefix"', tmp_path / "homebrew")
    r = which_python(tmp_path, [tmp_path / "bin"])
    assert (r.returncode, r.stdout.strip()) == (0, str(py313))


def test_a_venv_made_by_an_old_python_is_refused_before_any_install(tmp_path):
    venv = tmp_path / "venv"
    fake_python(venv / "bin", "python", "Python 3.9.6")
    fake_python(tmp_path / "brew", "python3.12", "Python 3.12.4")
    r = subprocess.run([BASH, str(SETUP), str(venv)], capture_output=True, text=True, timeout=30,
                       env={"PATH": str(tmp_path / "brew"), "HOME": str(tmp_path)})
    assert r.returncode == 1
    assert r.stderr.strip() == (f"setup: {venv} holds Python 3.9.6; mirror-mlx needs Python >= 3.10: "
                                f"remove {venv} (make clean) and run again")
    assert not (venv / "setup.log").exists()
