"""Human-readable quantities and the console for terminal output."""

from __future__ import annotations

from rich.console import Console


def make_console() -> Console:
    """A rich console; when stdout is not a terminal, wide enough that tables are not folded."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_count(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{int(n)}"


def fmt_flops(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} FLOP"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} us"


def short(n: float | None, suffix: str = "") -> str:
    """A compact figure for tables: 54.5M, 527k, 1.2T (with an optional unit suffix)."""
    if n is None:
        return "-"
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.3g}{unit}{suffix}" if v < 100 else f"{v:.0f}{unit}{suffix}"
    return f"{n:.0f}{suffix}"
