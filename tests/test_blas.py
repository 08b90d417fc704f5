"""The BLAS MLX runs on (mirror_mlx/blas.py): the preferred library when it is there, the next one, slower and
said once, when it is not; and MIRROR_MLX_BLAS naming one."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the preload is Linux's")


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("MIRROR_MLX_BLAS", "MIRROR_MLX_BLAS_SAID")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**clean, **env})


def test_without_the_preferred_library_it_runs_on_the_next_and_says_so_once():
    """The module alone, its first choice pointed at a file that is not there (as on a machine without it): MLX
    runs on the next library, right, and one line says so, also when a child process (the draft host) preloads."""
    missing = """
        import dataclasses, importlib.util
        spec = importlib.util.spec_from_file_location("blas", "mirror_mlx/blas.py")
        blas = importlib.util.module_from_spec(spec); spec.loader.exec_module(blas)
        first = blas.PREFERENCE[blas._arch()][0]
        blas.LIBRARIES[first] = dataclasses.replace(blas.LIBRARIES[first], path="/nonexistent/{arch}/lib.so")
        blas.preload()
        blas.preload()
    """
    out = run(missing + f"""
        import subprocess, sys, textwrap
        import mlx.core as mx
        print("PRODUCT", (mx.ones((3, 4)) @ mx.ones((4, 5))).sum().item())
        print("STATUS", blas.status())
        subprocess.run([sys.executable, "-c", textwrap.dedent({missing!r})], check=True)  # a child, as the draft host
    """)
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stderr.splitlines() if "is not installed; MLX runs on" in line]
    if "no tuned BLAS found" in out.stderr:
        pytest.skip(f"neither library is installed here: {out.stderr.strip()}")
    assert len(said) == 1 and "slower" in said[0] and "apt-get install" in said[0], out.stderr
    assert "PRODUCT 60.0" in out.stdout
    assert "is not installed (apt-get install" in out.stdout.split("STATUS", 1)[1]


@pytest.mark.parametrize("name", ["openblas", "blis"])
def test_mirror_mlx_blas_names_the_library_and_status_says_which(name):
    out = run("""
        import mirror_mlx, mlx.core as mx
        from mirror_mlx import blas
        print((mx.ones((3, 4)) @ mx.ones((4, 5))).sum().item(), blas.status())
    """, MIRROR_MLX_BLAS=name)
    if "names no library that loads" in out.stderr:
        pytest.skip(f"{name} is not installed here")
    assert out.returncode == 0, out.stderr
    product, status = out.stdout.split(" ", 1)
    assert product == "60.0" and f"MIRROR_MLX_BLAS={name}" in status
    assert {"openblas": "OpenBLAS", "blis": "BLIS"}[name] in status


def test_a_blas_that_is_not_there_is_said_in_one_sentence_and_mlx_still_runs():
    out = run("""
        import mirror_mlx, mlx.core as mx
        print((mx.ones((3, 4)) @ mx.ones((4, 5))).sum().item())
    """, MIRROR_MLX_BLAS="/nonexistent/libopenblas.so")
    assert out.returncode == 0 and out.stdout.strip() == "60.0", out.stderr
    assert out.stderr.count("MIRROR_MLX_BLAS=/nonexistent/libopenblas.so names no library that loads") == 1
