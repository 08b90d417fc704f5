"""`mirror-mlx bench`: Mirror-SD against mlx-lm's own generation and speculative decoding, same prompts,
one process (`run`), over a grid of knobs (`grid`), on a machine described and pinned (`machine`),
summed up (`summary`) and drawn (`report`); mlx-lm's baselines (`baselines`)."""
