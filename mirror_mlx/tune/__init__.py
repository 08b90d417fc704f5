"""Mode auto: calibrate the pair on this machine (`calibrate`), keep the result (`profile`), score and choose
configurations (`cost_model`), resolve each call and watch it (`policy`). Scripts enter by `profile_for(pipe)`
(the pipeline's profile, calibrated on first use) and `describe(config)`.
"""

from .cost_model import describe
from .policy import profile_for

__all__ = ["describe", "profile_for"]
