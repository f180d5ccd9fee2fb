"""The code keeps the shape the project agreed on: short functions, jax internals in one module,
benchmarks on public names only."""

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent
LONGEST_FUNCTION = 60
LONGEST_API = 230  # the public entry point reads in one sitting


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


def test_the_api_module_reads_in_one_sitting():
    # Concepts decide the other modules' lengths (one file per concept), not a line cap.
    assert len((ROOT / "oocjax/api.py").read_text().splitlines()) <= LONGEST_API


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_readme_reads_in_three_minutes():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def imports(path: Path, known: set[str]) -> set[str]:
    """The ``known`` modules ``path`` imports when it runs, in functions too; not those imported
    for type checking only (``if TYPE_CHECKING:``). ``from oocjax import plan_cache`` imports the
    submodule."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body
        for child in ast.walk(statement)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
            }
    return (found & known) - {module_name(path)}


def test_no_module_in_oocjax_imports_one_that_imports_it_back():
    known = {module_name(path) for path in modules("oocjax")}
    graph = {module_name(path): imports(path, known) for path in modules("oocjax")}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = {start}, [start]
        while todo:
            for after in graph[todo.pop()] - seen:
                seen.add(after)
                todo.append(after)
        return goal in seen

    circles = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if reaches(d, m))
    assert circles == []


def test_only_the_compat_module_touches_jax_internals():
    touching = [
        str(path.relative_to(ROOT))
        for path in modules("oocjax")
        if path.name != "compat.py" and ("jax._src" in path.read_text() or "jax.extend" in path.read_text())
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


# What benchmarks/ may import of oocjax: the user API, the planner's public names, and the window onto
# the internals that oocjax/testing.py keeps for them (issue 52).
BENCHMARK_MODULES = ("oocjax", "oocjax.schedule", "oocjax.testing")


def test_benchmarks_import_only_oocjax_oocjax_schedule_and_oocjax_testing_and_only_their_public_names():
    import importlib

    public = {name: set(importlib.import_module(name).__all__) for name in BENCHMARK_MODULES}

    def ours(module: str | None) -> bool:
        return (module or "").split(".")[0] == "oocjax"

    found = []
    for path in modules("benchmarks"):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Import):
                found += [f"{where}: import {a.name}" for a in node.names if ours(a.name) and a.name not in public]
            elif isinstance(node, ast.ImportFrom) and ours(node.module):
                allowed = public.get(node.module, set())
                found += [f"{where}: from {node.module} import {a.name}" for a in node.names if a.name not in allowed]
    assert found == []


def test_every_name_oocjax_testing_offers_resolves():
    import oocjax.testing

    missing = []
    for name in oocjax.testing.__all__:
        try:
            getattr(oocjax.testing, name)
        except (AttributeError, ImportError) as error:
            missing.append(f"{name}: {error}")
    assert missing == []


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


def test_no_two_top_level_classes_or_functions_in_oocjax_share_a_name():
    where: dict[str, list[str]] = {}
    for path in modules("oocjax"):
        for node in ast.parse(path.read_text()).body:
            is_definition = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            if is_definition and not node.name.startswith("__"):  # a module's __getattr__ is a protocol
                where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}


def test_no_oocjax_module_but_the_compat_one_declares_a_global():
    declaring = [
        str(path.relative_to(ROOT))
        for path in modules("oocjax")
        if path.name != "compat.py" and any(isinstance(n, ast.Global) for n in ast.walk(ast.parse(path.read_text())))
    ]
    assert declaring == []


def test_no_oocjax_module_imports_a_private_name_or_module_from_another():
    private = [
        f"{path.relative_to(ROOT)}: {node.module}.{alias.name}"
        for path in modules("oocjax")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("oocjax")
        for alias in node.names
        if alias.name.startswith("_") or any(part.startswith("_") for part in node.module.split("."))
    ]
    assert private == []


def oocjax_module_names(tree: ast.AST) -> set[str]:
    """The names a file binds to oocjax modules (``import oocjax.x as y``, ``from oocjax import x``)."""
    known = {module_name(path) for path in modules("oocjax")}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("oocjax")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("oocjax"):
            names |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in known}
    return names


def refers_to_a_module(target: ast.AST, names: set[str]) -> bool:
    if isinstance(target, ast.Constant) and isinstance(target.value, str):
        return target.value.startswith("oocjax")  # monkeypatch.setattr("oocjax.x.y", ...)
    while isinstance(target, ast.Attribute):
        target = target.value
    return isinstance(target, ast.Name) and target.id in names


def test_no_test_or_benchmark_assigns_to_an_oocjax_module_attribute():
    """Tests and benchmarks change what oocjax does through options and constructor seams
    (``pipeline.Seams``), never by replacing a module's names."""
    found = []
    for path in [*modules("tests"), *modules("benchmarks")]:
        tree = ast.parse(path.read_text())
        names = oocjax_module_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "setattr":
                hit = bool(node.args) and refers_to_a_module(node.args[0], names)
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                hit = any(isinstance(t, ast.Attribute) and refers_to_a_module(t.value, names) for t in targets)
            else:
                hit = False
            if hit:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
