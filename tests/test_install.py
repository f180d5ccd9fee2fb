"""The suite passes wherever oocjax is installed from: an sdist built from this tree carries what the tests
read, installs into a fresh virtual environment, and a fast subset of its tests passes there, outside any
git checkout, against the installed package."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

# What builds, tests and tools leave in a working tree: not part of the source an sdist is built from.
LEFT_BEHIND = shutil.ignore_patterns(
    ".git",
    ".venv*",
    "__pycache__",
    "*.egg-info",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    ".ipynb_checkpoints",
    "build",
    "dist",
    "out",
)

# Files the tests read, beyond oocjax itself: the README and docs/measurements.md (their generated figures
# are checked against the results files), the benchmarks and their results, the examples the tests import
# and run.
READ_BY_THE_TESTS = (
    "README.md",
    "docs/measurements.md",
    "pyproject.toml",
    "tests/conftest.py",
    "tests/support/zoo.py",
    "benchmarks/report.py",
    "benchmarks/gpu_check.py",
    "benchmarks/results",
    "examples/models.py",
    "examples/train_flax.py",
    "examples/train_resnet.py",
    "examples/train_lm.py",
    "examples/inspect_plan.ipynb",
)

# Fast tests that read those files or git, and one that plans and runs an example's step; the whole suite
# takes minutes.
SUBSET = (
    "tests/test_benchmarks.py::test_the_generated_measurements_and_the_readme_table_match_the_results_files",
    "tests/test_benchmarks.py::test_a_benchmark_records_the_commit_of_its_checkout_and_unknown_outside_one",
    "tests/schedule/test_boundaries.py::test_the_planner_imports_and_plans_with_jax_and_numpy_unavailable",
    "tests/test_examples.py::test_the_check_fails_when_the_budget_forces_no_offloads_or_is_exceeded",
    "tests/test_flax_examples.py::"
    "test_the_language_model_example_draws_the_same_dropout_masks_as_jax_jit_at_a_budget_that_recomputes_or_moves",
)


def run(command: list, **options) -> str:
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, check=False, **options)
    assert result.returncode == 0, f"{' '.join(map(str, command))}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def build_sdist(tmp_path: Path) -> Path:
    """An sdist of a copy of this tree (the build writes its egg-info next to the sources), built with this
    environment's setuptools: no build isolation, so no package index."""
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=LEFT_BEHIND)
    run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", tmp_path / "dist", source])
    (sdist,) = (tmp_path / "dist").glob("oocjax-*.tar.gz")
    return sdist


def fresh_virtualenv(path: Path) -> Path:
    """A new virtual environment that sees this one's packages (jax, flax, pytest, ...) through a .pth file,
    but not its oocjax: a directory named in a .pth file is put on sys.path, and the .pth files inside it,
    among them the editable install's finder, are not run."""
    run([sys.executable, "-m", "venv", "--without-pip", path])
    python = path / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    ours = dict.fromkeys(sysconfig.get_paths()[kind] for kind in ("purelib", "platlib"))
    (site / "dependencies.pth").write_text("".join(f"{directory}\n" for directory in ours))
    return python


@pytest.mark.slow
def test_an_sdist_installs_into_a_fresh_virtualenv_and_its_tests_pass_there_outside_a_git_checkout(tmp_path):
    pytest.importorskip("build", reason="building an sdist needs the test extra: pip install -e '.[test]'")
    sdist = build_sdist(tmp_path)
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path / "unpacked", filter="data")
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    missing = [name for name in READ_BY_THE_TESTS if not (unpacked / name).exists()]
    assert not missing, f"not in {sdist.name}: {missing}"
    assert list((unpacked / "benchmarks" / "results").glob("*.json"))
    assert not list(unpacked.rglob("__pycache__"))

    python = fresh_virtualenv(tmp_path / "venv")
    # Nothing of this tree reaches the new environment but the sdist: no PYTHONPATH; and git cannot find a
    # repository above the tmp directory.
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment["GIT_CEILING_DIRECTORIES"] = str(tmp_path)
    # This environment's pip installs into the new one (which has none), from the sdist alone.
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-index"]
    run([*pip, "--no-build-isolation", sdist], cwd=tmp_path, env=environment)
    # From the unpacked sdist, with its directory after site-packages (what --import-mode=append does below;
    # -P keeps the current directory off sys.path), oocjax is the installed one.
    imports = f"import sys; sys.path.append({str(unpacked)!r}); import oocjax, oocjax.schedule, oocjax.transforms"
    where = run([python, "-P", "-c", f"{imports}; print(oocjax.__file__)"], cwd=unpacked, env=environment)
    assert Path(where.strip()).is_relative_to(tmp_path / "venv"), where

    # So the tests run against the installed oocjax, and take tests, examples and benchmarks from the sdist.
    options = ["-q", "-p", "no:cacheprovider", "--import-mode=append", "--basetemp", tmp_path / "pytest"]
    output = run([python, "-P", "-m", "pytest", *options, *SUBSET], cwd=unpacked, env=environment)
    assert re.search(rf"\b{len(SUBSET)} passed\b", output) and "skipped" not in output, output
