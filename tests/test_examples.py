"""The examples run as users run them."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.slow
def test_the_nnx_example_trains_under_half_its_in_core_memory():
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_nnx.py"), "--steps", "150"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "offloads" in result.stdout and "loss" in result.stdout
