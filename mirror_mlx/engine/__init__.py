"""The engine: the Mirror-SD step loop (loop.py) and the target side it drives (target.py, tree.py,
recurrent.py, sampling.py, workers.py, ...).

`from mirror_mlx.engine import Engine` loads the loop on first use, not with the package: the draft host's
process imports the parts both sides read (model_parts, recurrent, workers) without the loop and the target.
"""

LOOP = ("Engine", "Generation", "StepRecord", "cut", "draft_context", "local_build", "overlap", "prefill_progress",
        "reuse_window")

__all__ = list(LOOP)


def __getattr__(name: str):
    if name in LOOP:
        from . import loop  # (on first use: a draft host's engine parts load no loop)

        return getattr(loop, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
