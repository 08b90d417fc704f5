"""coremltools (off macOS) and matplotlib are extras: without them the runtime works, and the commands
that need them say which extra to install instead of failing in an import."""

import sys

import pytest
from click.testing import CliRunner

from mirror_mlx.ane_draft.package_format import ConvertError, read_metadata
from mirror_mlx.cli import main


@pytest.fixture
def no_coremltools(monkeypatch):
    for name in [m for m in sys.modules if m == "coremltools" or m.startswith("coremltools.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "coremltools", None)  # `import coremltools` now raises ImportError


def test_convert_without_coremltools_names_the_extra(no_coremltools, tmp_path):
    for args in (["--out", str(tmp_path / "d.mlpackage")], ["--verify", str(tmp_path / "d.mlpackage")]):
        result = CliRunner().invoke(main, ["convert", "--draft-model", "mirror_mlx/demo/llama2xs", *args])
        assert result.exit_code == 2 and "pip install 'mirror-mlx[convert]'" in result.output
        assert "Traceback" not in result.output and not (tmp_path / "d.mlpackage").exists()


def test_reading_a_package_without_coremltools_names_the_extra(no_coremltools, tmp_path):
    with pytest.raises(ConvertError, match=r"coremltools is not installed.*mirror-mlx\[convert\]"):
        read_metadata(tmp_path / "draft.mlpackage")


def test_bench_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "mirror_mlx.bench.report", raising=False)  # imported again, without it
    result = CliRunner().invoke(main, ["bench", "--out", str(tmp_path / "b"), "--limit", "1"])
    assert result.exit_code == 2 and "pip install 'mirror-mlx[bench]'" in result.output
    assert not (tmp_path / "b").exists()  # refused before any model was loaded or file written
