"""Argument checks shared by the library, the engine and the command-line tools. Each takes the
argument's name and returns the value normalised, or raises TypeError (wrong kind) or ValueError (wrong
value) naming it; the command-line forms raise argparse's error instead."""
import argparse
import math
import numbers

import torch


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as an int when it is an integer (Python or numpy; not a bool, not a float) in [minimum,
    maximum]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_float(name: str, value) -> float:
    """`value` as a finite float when it is a real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def check_bool(name: str, value) -> bool:
    """`value` as a bool when it is one (Python's or numpy's; not an int)."""
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def token_id_list(name: str, ids) -> list[int]:
    """A list of Python ints from a list/tuple of ints or a 1-D integer numpy array / torch tensor."""
    if isinstance(ids, (str, bytes)) or isinstance(ids, numbers.Number) or ids is None:
        raise TypeError(f"{name} must be a sequence of token ids (ints), got {ids!r}")
    if isinstance(ids, torch.Tensor) or type(ids).__module__ == "numpy":
        dtype = ids.dtype
        integer = (not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
                   if isinstance(ids, torch.Tensor) else getattr(dtype, "kind", "") in ("i", "u"))
        if ids.ndim != 1 or not integer:
            raise TypeError(f"{name} must be a 1-D integer array or tensor, got {ids.ndim}-D of {dtype}")
        return [int(t) for t in ids.tolist()]
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"{name} must be a list of token ids, got {type(ids).__name__}")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{name}[{i}] must be an int token id, got {t!r} ({type(t).__name__})")
    return [int(t) for t in ids]


# ---- command-line flags (argparse `type=`) ---------------------------------------------------------------
def int_at_least(minimum: int):
    """An integer flag >= minimum."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def float_at_least(minimum: float):
    """A finite number flag >= minimum."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < minimum:
            raise argparse.ArgumentTypeError(f"must be a finite number >= {minimum:g}, got {text}")
        return value
    return parse
