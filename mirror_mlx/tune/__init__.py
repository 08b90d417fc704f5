"""Mode auto: calibrate the pair on this machine (`calibrate`, `mirror-mlx tune`), keep the result
(`profile`), score and choose configurations (`cost_model`: the latency model and the choice by it), resolve
each call and watch it (`policy`), and print what tune found (`report`).

`profile_for(pipe)` (the pipeline's profile, calibrated on first use) and `describe(config)` are the
entry points scripts use.
"""

from .cost_model import describe
from .policy import profile_for

__all__ = ["describe", "profile_for"]
