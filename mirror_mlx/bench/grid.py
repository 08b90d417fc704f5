"""`mirror-mlx bench` arguments: the modes and the (κ, γ, ℓ_e) sweep grid, parsed from text."""

import re

from ..options import CHOICES

MODES = CHOICES + ("mlx_sd",)  # ours (auto: the tuned choice) and mlx-lm's speculative decoding (ar is mlx-lm's own)
DEFAULT_MODES = ("mirror", "sd", "mlx_sd", "ar")  # `mirror-mlx bench` without --modes


def parse_modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {', '.join(bad) or '(none)'}: choose from {','.join(MODES)}")
    return modes


def layer_value(text: str, n_layers: int) -> int:
    """An exit layer: an integer, or an expression in N (the target's layers) like N/2 or 3N/4."""
    text = text.strip().replace(" ", "")
    if text.isdigit():
        return int(text)
    m = re.fullmatch(r"(\d*)N(?:/(\d+))?", text)
    if not m:
        raise ValueError(f"exit layer {text!r} is neither an integer nor like N/4, N/2, 3N/4")
    return max(1, int(m.group(1) or 1) * n_layers // int(m.group(2) or 1))


def parse_sweep(spec: str, n_layers: int, kappa: int, gamma: int, exit_layer: int) -> dict[str, list[int]]:
    """'kappa=1,4 gamma=3,5 exit=N/4,N/2' → value lists; a knob left out keeps its single value."""
    grid = {"kappa": [kappa], "gamma": [gamma], "exit": [exit_layer]}
    for part in spec.split():
        key, _, values = part.partition("=")
        if key not in grid or not values:
            raise ValueError(f"sweep part {part!r} is not kappa=..., gamma=... or exit=...")
        vals = [layer_value(v, n_layers) if key == "exit" else int(v) for v in values.split(",") if v]
        grid[key] = sorted(set(vals))
    return grid


def point_name(pt: dict) -> str:
    return f"k{pt['kappa']}-g{pt['gamma']}-e{pt['exit_layer']}"
