"""argparse value types that command-line entry points of every layer share (the CLI's and the bench
scripts'): plain functions of the text, raising argparse.ArgumentTypeError."""

from __future__ import annotations

import argparse


def int_list(text: str, what: str, minimum: int) -> list[int]:
    """An argparse type: comma-separated integers >= minimum, sorted, each once."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise argparse.ArgumentTypeError(f"{what} must be integers >= {minimum}, got {text!r}")
    return sorted(set(values))
