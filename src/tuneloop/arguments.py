"""Command-line values checked as argparse reads them: a value out of range is argparse's own error (exit 2, one
line naming the argument), never a traceback later."""

from __future__ import annotations

import argparse


def at_least_one(text: str) -> int:
    return _whole(text, "a whole number", 1, None, "it must be at least 1")


def ranks(text: str) -> int:
    return _whole(text, "a whole number of ranks", 1, None, "a run has at least 1 rank")


def seed(text: str) -> int:
    return _whole(text, "a whole number", 0, 2 ** 32 - 1, "a seed is from 0 to 4294967295")


def _whole(text: str, what: str, low: int, high: int | None, why: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"{value}: {why}")
    return value


def positive_gb(text: str) -> float:
    value = _number(text, "a number of GB")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value:g}: a device's memory is more than 0 GB")
    return value


def not_negative(text: str) -> float:
    value = _number(text, "a number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value:g}: it must be 0 or more")
    return value


def probability(text: str) -> float:
    value = _number(text, "a number")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value:g}: it must be above 0 and at most 1")
    return value


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value
