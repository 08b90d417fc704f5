"""The package's public surface: `__all__`, `load`'s typed signature (the one `pipeline.load` has, so
editors and type checkers see the real arguments), and the `py.typed` marker shipped with it."""

import inspect
from importlib.resources import files
from pathlib import Path

import pytest

import mirror_mlx
from mirror_mlx import pipeline

ROOT = Path(__file__).resolve().parents[1]


def test_all_names_exist_and_star_import_gives_them():
    namespace: dict = {}
    exec("from mirror_mlx import *", namespace)
    assert set(mirror_mlx.__all__) == {"__version__", "generate", "load", "stream_generate"}
    assert all(namespace[name] is getattr(mirror_mlx, name) for name in mirror_mlx.__all__)


def test_load_has_pipeline_loads_typed_signature():
    ours, theirs = inspect.signature(mirror_mlx.load), inspect.signature(pipeline.load)
    assert list(ours.parameters.values()) == list(theirs.parameters.values())
    assert all(p.annotation is not inspect.Parameter.empty for p in ours.parameters.values())
    assert ours.return_annotation == "Pipeline"


def test_load_refuses_an_unknown_keyword_by_name():
    with pytest.raises(TypeError, match="draft"):
        mirror_mlx.load(draft="x")  # draft_model is meant


def test_load_passes_every_argument_through():
    pipe = mirror_mlx.load(None, None, "none", adapter_path=None, tokenizer_config={}, trust_remote_code=False)
    try:
        assert isinstance(pipe, pipeline.Pipeline)
        assert pipe.engine.exit_adapter is None  # "none" reached pipeline.load: the demo's adapter is off
    finally:
        pipe.close()


def test_py_typed_ships_with_the_package():
    assert (files("mirror_mlx") / "py.typed").is_file()
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["mirror_mlx"]
