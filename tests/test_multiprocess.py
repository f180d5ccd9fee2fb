"""Two processes of 4 CPU devices each run one data-parallel step under ``ooc_jit`` (gloo collectives).

Every process derives the same plan with nothing exchanged but what ``jax.distributed`` does, and
the losses are ``jax.jit``'s. ``tests/support/multiprocess_step.py`` is one process.
"""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.background import cpu_devices_env

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_processes(count: int = 2, timeout_s: float = 300) -> list[dict]:
    env = cpu_devices_env(4)
    port = str(free_port())
    argv = [sys.executable, "-m", "tests.support.multiprocess_step"]
    procs = [
        subprocess.Popen(
            [*argv, str(i), str(count), port],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout_s)
            assert proc.returncode == 0, f"process failed:\n{err[-4000:]}"
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
    return reports


@pytest.mark.slow
def test_two_processes_plan_alike_and_train_as_jax_jit():
    reports = run_processes()
    assert [r["process"] for r in reports] == [0, 1]
    assert all(r["devices"] == 8 and r["local_devices"] == 4 for r in reports)
    assert len({r["plan_digest"] for r in reports}) == 1, "every process must launch the same programs"
    # Process 1 measured its arithmetic 1000x faster than process 0 did: both plan with process 0's rates.
    # Process 1 asked for 4 KiB more: both plan with the least budget.
    assert [r["agreed_budget"] for r in reports] == [reports[0]["budget"]] * 2
    assert reports[0]["moved_bytes"] or reports[0]["recomputed"], "the budget should make the plan move or recompute"
    for r in reports:
        np.testing.assert_allclose(r["losses"], r["jit_losses"], rtol=1e-5, atol=1e-6)
        assert r["result_devices"] == [8], "results stay on the whole mesh, never gathered onto one device"
        assert r["compiles_while_running"] == 0, "transfers copy each process's own shards, with no program"
    assert reports[0]["losses"] == reports[1]["losses"]
