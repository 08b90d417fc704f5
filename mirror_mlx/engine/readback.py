"""mlx arrays read back as the Python values the caller knows they hold. mlx's stubs say `tolist()` and `item()`
return a union of every shape and kind; these name the one each call site reads (a cast, nothing at run time)."""

from typing import cast

import mlx.core as mx


def ints(a: mx.array) -> list[int]:
    return cast(list[int], a.tolist())


def int_rows(a: mx.array) -> list[list[int]]:
    return cast(list[list[int]], a.tolist())


def floats(a: mx.array) -> list[float]:
    return cast(list[float], a.tolist())


def float_rows(a: mx.array) -> list[list[float]]:
    return cast(list[list[float]], a.tolist())


def scalar(a: mx.array) -> float:
    """A one-element float array's value."""
    return cast(float, a.item())


def integer(a: mx.array) -> int:
    """A one-element integer array's value."""
    return cast(int, a.item())
