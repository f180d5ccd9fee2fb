"""Byte quantities: parsing what users type and rendering for people."""

from __future__ import annotations

import re

MiB = 2**20  # the unit sizes and thresholds are written in (min_offload_bytes defaults to 1 MiB)

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """Parses ``"512MiB"``, ``"1.5 GB"``, ``"12GiB"`` or ``"4096"`` into a number of bytes.

    >>> parse_bytes("1.5KiB")
    1536
    """
    match = _QUANTITY.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or (unit not in _UNITS and unit != ""):
        accepted = ", ".join(sorted(_UNITS, key=_UNITS.get))
        raise ValueError(
            f"cannot read {text!r} as a number of bytes: write a number with one of the units "
            f"{accepted} (case does not matter), e.g. '12GiB' or '1.5GB'"
        )
    return int(float(match.group(1)) * _UNITS.get(unit, 1))


def format_bytes(nbytes: int, *, round_up: bool = False) -> str:
    """Renders a byte count with binary units, three significant digits.

    With ``round_up``, the last digit printed is rounded up rather than to the nearest, so that the
    figure read back (``parse_bytes``) is at least ``nbytes``: for a smallest budget, which users
    pass back as it is printed.

    >>> format_bytes(3 * 2**30 // 2), format_bytes(1010 * 1024)
    ('1.5 GiB', '1010 KiB')
    >>> format_bytes(24_894_632), format_bytes(24_894_632, round_up=True)
    ('23.7 MiB', '23.8 MiB')
    """
    if round_up and nbytes >= 0:
        return _format_bytes_up(nbytes)
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            # 1000-1023 have four digits: printed whole, not as 1.01e+03.
            return (
                f"{int(value)} B" if unit == "B" else f"{value:.0f} {unit}" if value >= 999.5 else f"{value:.3g} {unit}"
            )
        value /= 1024
    return f"{value:.3g} TiB"


def _format_bytes_up(nbytes: int) -> str:
    """``format_bytes`` rounded up, in integer arithmetic: a float's own rounding could land below."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while power < len(units) - 1 and nbytes >= 1024 ** (power + 1):
        power += 1
    if power == 0:
        return f"{nbytes} B"
    scale = 1024**power
    decimals = 2 if nbytes < 10 * scale else 1 if nbytes < 100 * scale else 0
    steps = -(-nbytes * 10**decimals // scale)  # ceil(nbytes / scale) in units of the last digit printed
    whole, fraction = divmod(steps, 10**decimals)
    text = f"{whole}.{fraction:0{decimals}d}".rstrip("0").rstrip(".") if decimals else str(whole)
    return f"{text} {units[power]}"


def counted(n: int, noun: str) -> str:
    """``1 segment``, ``3 segments``, ``2 prefetches``, ``2 softmaxes``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith(("h", "x")) else f"{n} {noun}s"
