"""The code keeps the shape the project agreed on: short functions, jax internals in one module,
benchmarks on public names only."""

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent
LONGEST_FUNCTION = 62  # "no function over about 60 lines"


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_no_function_in_oocjax_is_longer_than_about_sixty_lines():
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in modules("oocjax")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION
    ]
    assert not long, long


def test_only_the_compat_module_touches_jax_internals():
    touching = [
        str(path.relative_to(ROOT))
        for path in modules("oocjax")
        if path.name != "_compat.py" and ("jax._src" in path.read_text() or "jax.extend" in path.read_text())
    ]
    assert touching == []


def test_benchmarks_import_no_private_name_of_oocjax():
    private = [
        f"{path.name}: {alias.name} from {node.module}"
        for path in modules("benchmarks")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("oocjax")
        for alias in node.names
        if alias.name.startswith("_") or any(part.startswith("_") for part in node.module.split("."))
    ]
    assert private == []


def test_oocjax_reads_only_this_processs_devices():
    # In a multi-process run jax.devices()[0] belongs to process 0: reading its memory statistics
    # from another process crashes. Local devices, or the step's own, only.
    calls = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in modules("oocjax")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "devices"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "jax"
    ]
    assert calls == []
