"""`python -m mirror_mlx ...` is the `mirror-mlx` command."""

from mirror_mlx.cli import main

if __name__ == "__main__":
    main(prog_name="mirror-mlx")
