"""The layers of docs/architecture.md, checked on the source (``ast``, nothing imported).

The layer table is read from the document itself, so that the document and the check are one
source: imports only go down the layers, the module graph has no cycle and no module imports
a ``_private`` name of another. Every import counts: at the top, inside a function (a lazy
import) and under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional, Set

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rpc_reading_service"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    """The dotted name below the package of the module in ``path`` (``""`` for the package root)."""
    parts = list(path.relative_to(package).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_modules(package: Path = PACKAGE) -> Dict[str, Path]:
    """Every module of the package by its dotted name below the package."""
    return {module_name(path, package): path for path in sorted(package.rglob("*.py"))}


class Import(NamedTuple):
    """One name an import statement binds, resolved: the module it comes from (dotted, below
    the package) and the name taken from it (None: the module itself)."""

    line: int
    module: str
    name: Optional[str]


def imports_of(path: Path, modules: Dict[str, Path], package: Path = PACKAGE) -> List[Import]:
    """The package's modules and names that ``path`` imports, anywhere in the file."""
    return list(_imports_of(path, frozenset(modules), package))


@functools.lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    """``path``'s syntax tree (each file is parsed once)."""
    return ast.parse(path.read_text(), str(path))


def _imports_of(path: Path, modules: frozenset, package: Path) -> Iterator[Import]:
    own = module_name(path, package)
    here = own.split(".") if own else []
    if path.name != "__init__.py":
        here = here[:-1]
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == package.name:
                    yield Import(node.lineno, ".".join(parts[1:]), None)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == package.name:
                target = ".".join(node.module.split(".")[1:])
            else:
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}" if target else alias.name
                if submodule in modules:
                    yield Import(node.lineno, submodule, None)
                else:
                    yield Import(node.lineno, target, alias.name)


def import_graph(modules: Dict[str, Path], package: Path = PACKAGE) -> Dict[str, Set[str]]:
    """Module -> the modules it imports (a ``from a import name`` imports module ``a``)."""
    return {name: {i.module for i in imports_of(path, modules, package)} - {name} for name, path in modules.items()}


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One cycle of ``graph`` (its modules in import order, the first repeated at the end), or None."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target in graph and target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


class Layers(NamedTuple):
    """The layer table: layer names from the top down, and each prefix's layer (0 = the top)."""

    names: List[str]
    prefixes: Dict[str, int]

    def of(self, module: str) -> Optional[int]:
        """The layer of ``module``: that of its longest prefix in the table (``__init__``: the root)."""
        if module == "":
            return self.prefixes.get("__init__")
        parts = module.split(".")
        for end in range(len(parts), 0, -1):
            layer = self.prefixes.get(".".join(parts[:end]))
            if layer is not None:
                return layer
        return None


def read_layers(text: str) -> Layers:
    """The ``| layer | modules |`` table of ``text``, top layer first."""
    names: List[str] = []
    prefixes: Dict[str, int] = {}
    in_table = False
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else None
        if cells is None:
            if in_table:
                break
            continue
        if [cell.lower() for cell in cells] == ["layer", "modules"]:
            in_table = True
            continue
        if not in_table or set("".join(cells)) <= set("-: "):
            continue
        layer = len(names)
        names.append(cells[0])
        for prefix in re.findall(r"`([\w.]+)`", cells[1]):
            assert prefix not in prefixes, f"{prefix} is in two layers of the table"
            prefixes[prefix] = layer
    return Layers(names, prefixes)


MODULES = package_modules()
LAYERS = read_layers(ARCHITECTURE.read_text())


def test_the_layer_table_is_in_the_document_and_names_modules_that_exist():
    assert len(LAYERS.names) >= 5, f"no layer table (| layer | modules |) in {ARCHITECTURE}"
    for prefix in LAYERS.prefixes:
        exists = prefix == "__init__" or any(m == prefix or m.startswith(prefix + ".") for m in MODULES)
        assert exists, f"the layer table of docs/architecture.md names {prefix!r}, which is no module of the package"


@pytest.mark.parametrize("name", sorted(MODULES), ids=lambda name: name or "__init__")
def test_imports_only_go_down_the_layers(name):
    own = LAYERS.of(name)
    assert own is not None, f"{name or '__init__'} has no layer: add it to the table of docs/architecture.md"
    for line, target, _name in imports_of(MODULES[name], MODULES):
        assert target in MODULES, f"{name}:{line} imports {target!r}, which is no module of the package"
        layer = LAYERS.of(target)
        assert layer is not None, f"{name}:{line} imports {target}, which has no layer"
        assert layer >= own, (
            f"{name} ({LAYERS.names[own]}) imports {target} ({LAYERS.names[layer]}) at line {line}: "
            "a layer above it; imports only go down (docs/architecture.md)"
        )


def test_no_import_cycle():
    cycle = find_cycle(import_graph(MODULES))
    assert cycle is None, "an import cycle (lazy and TYPE_CHECKING imports count): " + " -> ".join(cycle or [])


def private_imports(modules: Dict[str, Path], package: Path = PACKAGE) -> Iterator[str]:
    """``module:line name`` of every ``_private`` name a module takes from another module of the
    package: imported, or read as an attribute of an imported module (``module._name``)."""
    for name, path in modules.items():
        tree = parsed(path)
        imported = imports_of(path, modules, package)
        aliases: Set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                bound = [alias.asname or alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                bound = [alias.asname or alias.name.split(".")[0] for alias in node.names if alias.asname]
            else:
                continue
            aliases.update(bound)
        for item in imported:
            if item.name and item.name.startswith("_") and not item.name.startswith("__") and item.module != name:
                yield f"{name}:{item.line} {item.name} from {item.module or '__init__'}"
        module_aliases = {
            alias for alias in aliases
            if any(i.name is None and i.module.rsplit(".", 1)[-1] == alias for i in imported)
        }  # fmt: skip
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in module_aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")
            ):  # fmt: skip
                yield f"{name}:{node.lineno} {node.value.id}.{node.attr}"


def test_no_private_name_crosses_a_module_boundary():
    found = list(private_imports(MODULES))
    assert found == [], "private names taken from another module (make them public, or move them):\n" + "\n".join(found)


def test_the_checks_see_an_upward_import_a_cycle_and_a_private_name(tmp_path):
    """The checks themselves, on a small package: each rule is seen where it is broken."""
    package = tmp_path / "rpc_reading_service"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("def f():\n    from ..high import b  # lazy: still an edge\n")
    (package / "low" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n")
    (package / "low" / "d.py").write_text("from .c import _secret\nfrom . import a\nx = a._hidden\n")
    (package / "high.py").write_text("import rpc_reading_service.low.a\n")
    (package / "b.py").write_text("")
    modules = package_modules(package)
    layers = read_layers("| layer | modules |\n|---|---|\n| top | `high`, `b`, `__init__` |\n| bottom | `low` |\n")
    assert layers.names == ["top", "bottom"] and layers.of("low.c") == 1 and layers.of("") == 0
    graph = import_graph(modules, package)
    assert graph["low.a"] == {"high"} and graph["high"] == {"low.a"}
    upward = [(m, t) for m in modules for _l, t, _n in imports_of(modules[m], modules, package) if layers.of(t) < layers.of(m)]
    assert ("low.a", "high") in upward
    assert find_cycle(graph) in (["high", "low.a", "high"], ["low.a", "high", "low.a"])
    assert find_cycle({"low.c": {"low.d"}, "low.d": {"low.c"}}) == ["low.c", "low.d", "low.c"]
    assert find_cycle({"x": {"y"}, "y": set()}) is None
    assert sorted(private_imports(modules, package)) == ["low.d:1 _secret from low.c", "low.d:3 a._hidden"]


def test_no_module_imports_the_package_root():
    # The root imports everything (the reading service, transports...): importing it from
    # below runs imports upward and in circles. The version has its own module for this.
    offending = [
        f"{name}:{line}" for name, path in MODULES.items() if name
        for line, target, _n in imports_of(path, MODULES) if target == ""
    ]  # fmt: skip
    assert offending == [], f"modules importing the package root: {offending}"


IO_MODULES = {"socket", "selectors", "select", "ssl", "threading", "asyncio", "multiprocessing", "subprocess"}


@pytest.mark.parametrize("path", sorted((PACKAGE / "protocol").glob("*.py")), ids=lambda p: p.name)
def test_the_protocol_does_no_io(path):
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        for module in names:
            assert module.split(".")[0] not in IO_MODULES, f"protocol/{path.name} imports {module}: the protocol is sans-I/O"


#: torchdata's DataLoader2 itself: only the front ends know it.
DATALOADER2_MODULES = {"torchdata.dataloader2.dataloader2", "torchdata.dataloader2.reading_service"}


def test_only_the_front_ends_know_dataloader2():
    front = LAYERS.names.index("front ends")
    for name, path in MODULES.items():
        if LAYERS.of(name) == front:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level:
                assert node.module not in DATALOADER2_MODULES, f"{name} imports {node.module}"
                taken = {"DataLoader2", "ReadingServiceInterface"} & {a.name for a in node.names}
                assert not (node.module == "torchdata.dataloader2" and taken), f"{name} imports {taken}"


def test_no_module_is_over_700_lines():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > 700}
    assert long == {}, f"modules over 700 lines (split them along a seam): {long}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("worker.") or n.startswith("trainer.")))
def test_drivers_know_transports_only_through_their_interface(name):
    """Workers and the trainer use a transport's ``Connection`` interface (``transports.base``) or
    its registry (``transports``), never one transport's own pieces."""
    inner = [imp.module for imp in imports_of(MODULES[name], MODULES)
             if imp.module.startswith("transports.") and imp.module != "transports.base"]
    assert inner == [], f"{name} imports {inner}: a transport's pieces stay inside it"
