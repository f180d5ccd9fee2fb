"""Reading the ``budget`` users give to ``ooc_jit``."""

from __future__ import annotations

from typing import Any

from oocjax.schedule import parse_bytes

ACCEPTED = (
    "an int number of bytes, a string with units ('512MiB', '1.5GB', '12GiB'), "
    "or a fraction of the device's memory (0.8 or '80%')"
)


def resolve_budget(budget: int | float | str, device: Any) -> int:
    """The budget in bytes. Fractions need a device that reports its memory size (GPUs do, CPUs do not).

    >>> resolve_budget("1.5KiB", device=None)
    1536
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise TypeError(f"budget must be {ACCEPTED}; got {budget!r}")
    if isinstance(budget, str) and budget.strip().endswith("%"):
        try:
            fraction = float(budget.strip()[:-1]) / 100
        except ValueError:
            raise ValueError(f"cannot read budget {budget!r}: it must be {ACCEPTED}") from None
        return _fraction_of_device(fraction, device, budget)
    if isinstance(budget, float):
        return _fraction_of_device(budget, device, budget)
    nbytes = parse_bytes(budget) if isinstance(budget, str) else budget
    if nbytes <= 0:
        raise ValueError(f"budget must be positive; got {budget!r}")
    return nbytes


def _fraction_of_device(fraction: float, device: Any, given: Any) -> int:
    if not 0 < fraction <= 1:
        raise ValueError(f"a fractional budget must be in (0, 1] (or '1%' to '100%'); got {given!r}")
    stats = device.memory_stats() if device is not None else None
    if not stats or "bytes_limit" not in stats:
        platform = getattr(device, "platform", "this device")
        raise ValueError(
            f"budget {given!r} is a fraction of device memory, but {platform} does not report its memory "
            "size (CPUs do not): give the budget in bytes instead, e.g. budget='2GiB'"
        )
    return int(stats["bytes_limit"] * fraction)
