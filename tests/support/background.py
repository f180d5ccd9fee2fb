"""Processes a test module's tests wait on, started before the tests ask for them, two at a time.

One such process (an example script, a layout of ``tests/support/sharded_steps.py``) keeps about one and a
half of this project's two CPU cores busy, in bursts: started together, two of them finish sooner
than one after the other, and a process started while the module's in-process tests run uses the
core they leave idle. A module queues only what its selected tests ask for, and ends with what it
queued (``close``): nothing runs on under the next module's tests, whose plans may depend on the
rates they measure.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import threading
from collections.abc import Sequence


def cpu_devices_env(count: int) -> dict[str, str]:
    """This process's environment for a child jax process on ``count`` virtual CPU devices, with the
    tests' own XLA flags (``conftest.py``) kept."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")


class Processes:
    """Commands queued by name, run ``at_a_time`` at once, each in its own process."""

    def __init__(self, at_a_time: int = 2):
        self._pool = concurrent.futures.ThreadPoolExecutor(at_a_time)
        self._runs: dict[str, concurrent.futures.Future] = {}
        self._started: list[subprocess.Popen] | None = []  # None once closed: no more start
        self._starting = threading.Lock()

    def queue(self, name: str, command: Sequence, **options) -> None:
        """Queues ``command`` (``subprocess.Popen``'s ``options``, output captured as text) under
        ``name``, unless a command of that name is queued already."""
        if name not in self._runs:
            self._runs[name] = self._pool.submit(self._run, [str(part) for part in command], options)

    def result(self, name: str, timeout: float | None = None) -> subprocess.CompletedProcess:
        """The queued command's finished process: its return code, stdout and stderr (``TimeoutError``
        after ``timeout`` seconds; ``close`` ends the process)."""
        return self._runs[name].result(timeout)

    def close(self) -> None:
        """Drops what has not started, and ends what is still running."""
        for run in self._runs.values():
            run.cancel()
        with self._starting:
            started, self._started = self._started, None
        for process in started:
            process.kill()
            process.wait()
        self._pool.shutdown(wait=True)

    def _run(self, command: list[str], options: dict) -> subprocess.CompletedProcess:
        with self._starting:
            if self._started is None:
                return subprocess.CompletedProcess(command, -1, "", "not run: its module's tests had ended")
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **options)
            self._started.append(process)
        out, err = process.communicate()
        return subprocess.CompletedProcess(command, process.returncode, out, err)
