"""Reading the sizes users give to ``ooc_jit`` (the budget, and byte-sized planner options), and what
"budget" means for one plan."""

from __future__ import annotations

import numbers
import os
import re
from dataclasses import dataclass
from typing import Any

from oocjax.schedule import parse_bytes

ACCEPTED = (
    "an int number of bytes, a string with units ('512MiB', '1.5GB', '12GiB'), "
    "or a fraction of the device's memory (0.8, '0.8' or '80%')"
)
_PLAIN_NUMBER = re.compile(r"^\s*[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?\s*$")


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """What "budget" means for one plan, in one place.

    Attributes:
      user_bytes: the user's budget (``ooc_jit(budget=...)``): what a call may use on the device.
      headroom_bytes: left free within it for the device allocator's own overhead.
    """

    user_bytes: int
    headroom_bytes: int

    @property
    def planned_bytes(self) -> int:
        """What plans, segments and the executor's gate hold to."""
        return self.user_bytes - self.headroom_bytes


def resolve_budget(budget: int | float | str, device: Any) -> int:
    """The budget in bytes. Fractions need a device that reports its memory size (GPUs do, CPUs do not).

    >>> resolve_budget("1.5KiB", device=None)
    1536
    """
    if isinstance(budget, str):
        text = budget.strip()
        if text.endswith("%"):
            return _fraction_of_device(_number(text[:-1], budget) / 100, device, budget)
        if _PLAIN_NUMBER.match(text) and not text.isdigit():
            # "0.8" is a fraction, as 0.8 is; "1.5" is neither a fraction nor a whole number of bytes.
            return _fraction_of_device(_number(text, budget), device, budget)
    if isinstance(budget, numbers.Real) and not isinstance(budget, numbers.Integral):  # 0.8, np.float32(0.8)
        return _fraction_of_device(budget, device, budget)
    return resolve_bytes("budget", budget)


def resolve_bytes(option: str, value: Any, *, allow_zero: bool = False) -> int:
    """A size in bytes: an integer of any integer type, or a string with units (``"1MiB"``)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
        raise TypeError(f"{option} must be {_bytes_accepted(option)}; got {value!r}")
    try:
        nbytes = parse_bytes(value) if isinstance(value, str) else int(value)
    except ValueError as error:
        raise ValueError(f"{option}: {error}") from None
    if nbytes < 0 or (nbytes == 0 and not allow_zero):
        raise ValueError(f"{option} must be {'non-negative' if allow_zero else 'positive'}; got {value!r}")
    return nbytes


def _bytes_accepted(option: str) -> str:
    return ACCEPTED if option == "budget" else "an int number of bytes or a string with units ('1MiB', '1.5GB')"


def _number(text: str, given: Any) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"cannot read budget {given!r}: it must be {ACCEPTED}") from None


def _fraction_of_device(fraction: float, device: Any, given: Any) -> int:
    if not 0 < fraction <= 1:
        raise ValueError(
            f"a fractional budget must be in (0, 1] (or '1%' to '100%'); got {given!r}. "
            "For bytes give an int or units: budget='1.5GiB'"
        )
    stats = device.memory_stats() if device is not None else None
    if not stats or "bytes_limit" not in stats:
        platform = getattr(device, "platform", "this device")
        raise ValueError(
            f"budget {given!r} is a fraction of device memory, but {platform} does not report its memory "
            "size (CPUs do not): give the budget in bytes instead, e.g. budget='2GiB'"
        )
    return int(stats["bytes_limit"] * float(fraction))


def available_host_bytes() -> int | None:
    """Host memory the machine has available now (Linux: ``MemAvailable``; elsewhere the free
    physical pages), or None where the system does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
