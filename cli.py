"""`python cli.py ...` from a checkout is the `mirror-mlx` command (mirror_mlx/cli/)."""
from mirror_mlx.cli import main

if __name__ == "__main__":
    main(prog_name="mirror-mlx")
