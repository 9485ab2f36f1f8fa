"""argparse value types shared by the command-line entry points.

A bad number gets argparse's usual one-line usage error that names the flag,
instead of a traceback from deep inside the program.
"""

from __future__ import annotations

import argparse

__all__ = ["non_negative_int", "positive_float", "positive_int"]


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value
