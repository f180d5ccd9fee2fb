"""Where a benchmark ran, recorded next to its figures."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def source_commit(root: Path = ROOT) -> str:
    """The short commit of the git checkout whose top is ``root``; ``"unknown"`` where ``root`` is not the top
    of one (an unpacked sdist or ``git archive``, also when it lies inside another repository) or git is missing."""

    def git(*args: str) -> str | None:
        try:
            result = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
        except OSError:
            return None
        return result.stdout.strip() if result.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root.resolve():
        return "unknown"
    return git("rev-parse", "--short", "HEAD") or "unknown"


def machine() -> dict:
    commit = source_commit()
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
