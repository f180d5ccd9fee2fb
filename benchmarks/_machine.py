"""Where a benchmark ran, recorded next to its figures."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess


def machine() -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        pass
    return dict(
        date=datetime.date.today().isoformat(),
        commit=commit,
        machine=f"{cpu or platform.machine()}, {os.cpu_count()} cores",
        python=platform.python_version(),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
    )
