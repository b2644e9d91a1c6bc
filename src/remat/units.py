"""Units: byte and duration figures, formatted the one way remat prints them."""

from __future__ import annotations

__all__ = ["KIB", "MIB", "format_bytes", "format_seconds"]

KIB = 1024
MIB = 1024 * 1024


def format_bytes(n_bytes: float) -> str:
    """Formats a byte count for people: ``1536`` -> ``"1.50 KiB"``."""
    value = float(n_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024.0 or unit == "GiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.2f} {unit}"
        value /= 1024.0
    return f"{sign}{value:.2f} TiB"  # pragma: no cover


def format_seconds(seconds: float) -> str:
    """Formats a duration for people: ``0.0123`` -> ``"12.30 ms"``."""
    magnitude = abs(seconds)
    if magnitude >= 1.0 or magnitude == 0.0:
        return f"{seconds:.3f} s"
    if magnitude >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"
