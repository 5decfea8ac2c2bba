"""No import circle among the suite's modules, function-local imports included (read from the source:
every `import` statement, wherever it is; tests/launch/test_layers.py holds the packages' order by loading them)."""

import ast

from conftest import REPO

PACKAGES = ["gptlite", "models", "core", "backends", "estimator", "training", "simulation", "orchestration", "analysis"]


def _module_of(path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """{module: the suite's modules it imports}, from every import statement in its source."""
    files = {_module_of(p): p for package in PACKAGES for p in (REPO / package).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x
                    base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                if name in files and name != module:
                    graph[module].add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    assert circles(import_graph()) == set()


def test_the_check_finds_a_circle_through_a_function_local_import():
    graph = {"a": {"b"}, "b": set(), "c": set()}
    assert circles(graph) == set()
    graph["b"].add("a")  # e.g. `def f(): from a import g` in b
    assert circles(graph) == {frozenset({"a", "b"})}
    graph = import_graph()
    graph["gptlite.model"].add("training.run")  # the model reaching up into the run
    assert any("gptlite.model" in c and "training.run" in c for c in circles(graph))


def test_every_name_a_script_imports_from_the_suite_exists():
    """The scripts no test runs whole (benchmarks/, tools/) and train.py and sweep.py import only names the
    suite still has: a name removed from a module is otherwise found when someone next runs the script
    (benchmarks/compile_probe.py imported core.flops.flops_per_token for 12 days after it went)."""
    import importlib

    scripts = [*(REPO / "benchmarks").rglob("*.py"), *(REPO / "tools").rglob("*.py"), REPO / "train.py",
               REPO / "sweep.py"]
    missing = []
    for path in scripts:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and not node.level and node.module
                    and node.module.split(".")[0] in [*PACKAGES, "benchmarks"]):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if alias.name == "*" or hasattr(module, alias.name):
                    continue
                try:
                    importlib.import_module(f"{node.module}.{alias.name}")
                except ModuleNotFoundError:
                    missing.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{alias.name}")
    assert not missing, missing
