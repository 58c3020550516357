"""argparse helpers the `plan` commands share (``planner.cli`` and ``planner.report.whatif_table``):
a small leaf module, so the report code does not import the CLI that imports it.
"""

from __future__ import annotations

import argparse
import math

from planner.errors import BadInput


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    """A positive, finite number (seconds, GiB, Gb/s): nan, inf, 0 and negatives are refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive and finite, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse that raises BadInput (one line, exit 2) instead of printing usage and exiting.

    Every float flag of these commands is a positive quantity (seconds, GiB, Gb/s), so a flag
    declared with ``type=float`` gets `_positive_float`: nan, inf, 0 or a negative number is
    refused with the flag's name ("plan: --memory-limit must be positive and finite, got 'nan'").
    A flag that needs zero or negative numbers declares its own type."""

    def add_argument(self, *args, **kwargs):  # type: ignore[override]
        if kwargs.get("type") is float:
            kwargs["type"] = _positive_float
        return super().add_argument(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        # argparse words a type function's refusal "argument --flag: must be ..."; say "--flag must be ..."
        flag, sep, rest = message.partition(": must be ")
        if sep and flag.startswith("argument -") and " " not in flag[len("argument "):]:
            message = f"{flag[len('argument '):]} must be {rest}"
        raise BadInput(f"{self.prog}: {message}")
