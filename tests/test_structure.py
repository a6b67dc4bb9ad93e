"""The package's shape, checked from its source (AST): no import cycles, no function over
MAX_FUNCTION_LINES lines and no module over MAX_MODULE_LINES lines in specdeploy/; benchmarks/ and
scripts/ use specdeploy's public names only, with no sys.path imports; and tests/ reach no private names."""

import ast
from pathlib import Path

import pytest

import specdeploy

MAX_FUNCTION_LINES = 60  # a function's `def` line through its last line (decorators not counted)
MAX_MODULE_LINES = 420
ROOT = Path(specdeploy.__file__).parent


def _module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def package_imports() -> dict[str, set[str]]:
    """specdeploy's modules -> the package modules each imports anywhere in its body (a function's
    import included: it makes a cycle as much as a top-level one). A parent package is not an edge:
    Python runs it before any of its modules."""
    names = _module_names()
    graph = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in names] or [module]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            imported |= {t for t in targets if t in names and t != name and not name.startswith(t + ".")}
        graph[name] = imported
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as the modules along it (first == last), or None."""
    done, path = set(), []

    def visit(name):  # depth first; a module met again on the current path closes a cycle
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        path.append(name)
        for imported in sorted(graph.get(name, ())):
            cycle = visit(imported)
            if cycle:
                return cycle
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        cycle = visit(name)
        if cycle:
            return cycle
    return None


def oversized(source: str, label: str) -> list[str]:
    """The functions over MAX_FUNCTION_LINES and the module over MAX_MODULE_LINES in source, one line each."""
    found = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{label}: {lines} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{label}:{node.lineno} {node.name}: {length} lines (at most {MAX_FUNCTION_LINES})")
    return found


def test_the_cycle_finder_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles_in_the_package():
    graph = package_imports()
    assert {"specdeploy.swap", "specdeploy.manifest"} <= graph["specdeploy.bundle"]  # the walk sees the imports
    assert "specdeploy.runtime.engine" in graph["specdeploy.export.parity"]  # function-level relative imports too
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_size_check_counts_functions_and_modules():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))  # with its def: one line too many
    assert oversized(f"def long():\n{body}\n", "m.py") == [f"m.py:1 long: {MAX_FUNCTION_LINES + 1} lines "
                                                           f"(at most {MAX_FUNCTION_LINES})"]
    nested = "class C:\n    async def method(self):\n" + "\n".join("        pass" for _ in range(MAX_FUNCTION_LINES))
    assert [line.split(" ")[1] for line in oversized(nested, "m.py")] == ["method:"]
    assert oversized("x = 1\n" * MAX_MODULE_LINES, "m.py") == []
    assert oversized("x = 1\n" * (MAX_MODULE_LINES + 1), "m.py") == [f"m.py: {MAX_MODULE_LINES + 1} lines (at most 420)"]


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_no_function_or_module_over_the_limits(path):
    assert oversized(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT.parent))) == []


def test_no_test_is_shadowed_by_a_later_one_of_the_same_name():
    """A test module that defines a test twice runs only the later one: the first never runs."""
    from collections import Counter

    shadowed = []
    for path in sorted(Path(__file__).resolve().parent.glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        scopes = [tree.body] + [node.body for node in tree.body if isinstance(node, ast.ClassDef)]
        for body in scopes:
            names = Counter(node.name for node in body
                            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"))
            shadowed += [f"{path.name}: {name}" for name, count in names.items() if count > 1]
    assert not shadowed


# The tools beside the package use what a user can: its public names. gpu_check.py runs on a device machine
# before anything is installed, so it alone puts the checkout on sys.path (its comment says so).
TOOL_FOLDERS = ("benchmarks", "scripts")
SYS_PATH_ALLOWED = {"scripts/gpu_check.py"}
ATTRIBUTE_FUNCTIONS = ("getattr", "setattr", "delattr", "hasattr")  # builtins, and monkeypatch's setattr / delattr


def _private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def _own(node: ast.expr) -> bool:
    """self or cls: an object's private names are its own to use."""
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def private_names(source: str, label: str) -> list[str]:
    """Each import of a private specdeploy name (a module or name starting with "_", dunders aside), each private
    attribute read from anything but self or cls, and each private attribute named in a string to getattr, setattr,
    delattr or hasattr (monkeypatch.setattr's among them: an object and a name, or a "specdeploy.module._name"
    target), one line each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "specdeploy":
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.split(".")[0] == "specdeploy"]
        found += [f"{label}:{node.lineno} imports {name}" for name in names if _private(name)][:1]
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
            found.append(f"{label}:{node.lineno} reads {ast.unparse(node)}")
        function = getattr(node, "func", None)
        if isinstance(node, ast.Call) and getattr(function, "attr", getattr(function, "id", None)) in ATTRIBUTE_FUNCTIONS:
            strings = [(i, a.value) for i, a in enumerate(node.args[:2]) if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            for index, name in strings:
                target = index == 0 and name.startswith("specdeploy.")  # monkeypatch.setattr("specdeploy.x._y", value)
                if (target or index == 1 and not _own(node.args[0])) and _private(name):
                    found.append(f"{label}:{node.lineno} names {name} in {ast.unparse(node.func)}")
    return found


def private_uses(source: str, label: str) -> list[str]:
    """private_names, and each change to sys.path in source, one line each."""
    found = private_names(source, label)
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys" and label not in SYS_PATH_ALLOWED):
            found.append(f"{label}:{node.lineno} uses sys.path")
    return found


def test_the_private_name_check_finds_imports_attributes_and_sys_path():
    source = ("from specdeploy.cli import _return_freed_memory\nimport specdeploy.runtime._fastsample\n"
              "from specdeploy.runtime import load, __version__\nimport sys\nsys.path.insert(0, 'scripts')\n"
              "generator._request(1)\nself._build()\n")
    assert sorted(line.split(" ", 1)[1] for line in private_uses(source, "m.py")) == [
        "imports specdeploy.cli._return_freed_memory", "imports specdeploy.runtime._fastsample", "reads generator._request",
        "uses sys.path"]


def test_the_private_name_check_finds_private_names_given_as_strings():
    source = ("monkeypatch.setattr(engine, '_run', fake)\nmonkeypatch.setattr('specdeploy.swap._exchange', fake)\n"
              "getattr(worker, '_thread')\nsetattr(self, '_cache', None)\nmonkeypatch.setattr(sampling, 'CProcessor', None)\n"
              "hasattr(module, '__file__')\nmonkeypatch.setenv('_HIDDEN', '1')\n")
    assert [line.split(" ", 1)[1] for line in private_names(source, "t.py")] == [
        "names _run in monkeypatch.setattr", "names specdeploy.swap._exchange in monkeypatch.setattr",
        "names _thread in getattr"]


@pytest.mark.parametrize("path", sorted(p for folder in TOOL_FOLDERS for p in (ROOT.parent / folder).glob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_benchmarks_and_scripts_use_public_names_only(path):
    assert private_uses(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT.parent))) == []


# Tests drive public methods: they reach no private attribute of a specdeploy object (nor, by style rule 14, of a
# library's), so that an implementation can change behind its public seams without touching them. A test's own
# object keeps its private names to itself (self and cls).
@pytest.mark.parametrize("path", sorted(Path(__file__).resolve().parent.glob("*.py")), ids=lambda p: p.name)
def test_tests_use_public_names_only(path):
    assert private_names(path.read_text(encoding="utf-8"), f"tests/{path.name}") == []
