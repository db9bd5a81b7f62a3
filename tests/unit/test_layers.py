"""The layering of docs/DESIGN.md ("Layers"), read from the source with ast: every import of src/dockrl counts,
at module level or inside a function (a late import is still a dependency).

- config/ imports no other dockrl package (dockrl.errors, which imports nothing of dockrl, excepted) but the
  torch-free registries of REGISTRIES (model families, rollout backends, the algorithm registry), which import
  no torch, no Ray and no other dockrl package themselves;
- engines/, algos/, rewards/, models/, data/, config/ never import ray;
- workers/ never import recipes/;
- no import cycle between packages (a package is a folder of src/dockrl, or a top-level module such as cli.py),
  and none between the modules of one package.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "dockrl"
NO_RAY = ("engines", "algos", "rewards", "models", "data", "config")
SHARED = {"errors", "user_code"}  # modules every layer may import (they import nothing of dockrl)
# torch-free registries config/ may read (tests/distributed/test_light_imports.py checks they load no torch)
REGISTRIES = ("dockrl.models.families", "dockrl.backends", "dockrl.algos.registry")


def _module_name(path: Path) -> str:
    """src/dockrl/config/schema.py -> dockrl.config.schema; a package's __init__.py is the package."""
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module name `path` imports anywhere in it (`from a.b import c` gives a.b and a.b.c)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    """dockrl module -> the dockrl modules it imports (names that are not modules, like a function, dropped)."""
    files = sorted(SRC.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    return {_module_name(f): {m for m in _imports(f) if m in modules and m != _module_name(f)} for f in files}


def _package(module: str) -> str:
    """dockrl.config.schema -> config; dockrl.cli -> cli; dockrl -> dockrl."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, imported in graph.items():
        source = _package(module)
        packages.setdefault(source, set()).update(_package(m) for m in imported if _package(m) != source)
    packages.pop("dockrl", None)  # the root __init__ (a version string) is nobody's layer
    return packages


def _files_of(package: str) -> list[Path]:
    path = SRC / package
    return sorted(path.rglob("*.py")) if path.is_dir() else [SRC / f"{package}.py"]


def _in_registry(module: str) -> bool:
    return any(module == r or module.startswith(f"{r}.") for r in REGISTRIES)


def test_config_imports_no_other_dockrl_package():
    bad = {
        str(f.relative_to(SRC)): sorted(
            m
            for m in _imports(f)
            if m.startswith("dockrl.") and _package(m) not in ("config", *SHARED) and not _in_registry(m)
        )
        for f in _files_of("config")
    }
    assert {f: m for f, m in bad.items() if m} == {}


def _registry_files(registry: str) -> list[Path]:
    path = SRC.parent / registry.replace(".", "/")
    return sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]


def test_registries_import_no_torch_ray_or_other_dockrl_package():
    files = [f for r in REGISTRIES for f in _registry_files(r)]
    assert all(f.is_file() for f in files) and files, REGISTRIES
    bad = [
        f"{f.relative_to(SRC)}: {m}"
        for f in files
        for m in _imports(f)
        if m.split(".")[0] in ("torch", "ray")
        or m.startswith("dockrl.")
        and not _in_registry(m)
        and _package(m) not in SHARED
    ]
    assert bad == []


def test_shared_modules_import_nothing_of_dockrl():
    for name in SHARED:
        assert not [m for m in _imports(SRC / f"{name}.py") if m.startswith("dockrl")], name


def test_pure_layers_never_import_ray():
    bad = [
        f"{f.relative_to(SRC)}: {m}"
        for package in NO_RAY
        for f in _files_of(package)
        for m in _imports(f)
        if m == "ray" or m.startswith("ray.")
    ]
    assert bad == []


def test_workers_never_import_recipes():
    bad = [
        f"{f.relative_to(SRC)}: {m}"
        for f in _files_of("workers")
        for m in _imports(f)
        if m == "dockrl.recipes" or m.startswith("dockrl.recipes.")
    ]
    assert bad == []


def test_no_import_cycle_between_packages():
    assert _cycles(_package_graph(_graph())) == []


def test_no_import_cycle_between_modules():
    assert _cycles(_graph()) == []


def test_the_walk_finds_what_is_there():
    """The checks above can fail: the walk sees late imports and names the packages a module uses."""
    graph = _graph()
    assert "dockrl.config.schema" in graph["dockrl.config.step_plan"]
    assert "dockrl.observe.loggers" in graph["dockrl.recipes.preflight"]  # imported inside a function
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _package_graph({"dockrl.x.m": {"dockrl.y.n"}, "dockrl.y.n": {"dockrl.x.k"}}) == {
        "x": {"y"},
        "y": {"x"},
    }
