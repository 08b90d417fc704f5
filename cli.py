"""Kept for old imports: the command line lives in mirror_mlx/cli.py (`python -m mirror_mlx`)."""
from mirror_mlx.cli import main  # noqa: F401
