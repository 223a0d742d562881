"""The layers of DESIGN.md, checked on the source: imports only go down."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import List

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rpc_reading_service"
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def imports_of(path: Path):
    """``(level, module, names)`` of every import statement in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            yield node.level, node.module or "", [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield 0, alias.name, []


def resolves_to_package_root(path: Path, level: int, module: str) -> bool:
    if level == 0:
        return module == "rpc_reading_service"
    depth = len(path.relative_to(PACKAGE).parts) - 1  # folders below the package root
    return not module and level == depth + 1


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_the_package_root(path):
    # The root imports everything (the reading service, transports...): importing it from
    # below runs imports upward and in circles. The version has its own module for this.
    offending = [
        (level, module, names)
        for level, module, names in imports_of(path)
        if resolves_to_package_root(path, level, module)
    ]
    assert offending == [], f"{path.relative_to(PACKAGE)} imports the package root: {offending}"


IO_MODULES = {"socket", "selectors", "select", "ssl", "threading", "asyncio", "multiprocessing", "subprocess"}


@pytest.mark.parametrize("path", sorted((PACKAGE / "protocol").glob("*.py")), ids=lambda p: p.name)
def test_the_protocol_does_no_io_and_imports_only_below_it(path):
    for level, module, names in imports_of(path):
        top = module.split(".")[0]
        assert level or top not in IO_MODULES, (
            f"protocol/{path.name} imports {module}: the protocol is sans-I/O"
        )
        if level >= 2:  # out of protocol/: only the layers below (errors, version, safe_text)
            assert module in ("errors", "version", "safe_text", "serialization"), (
                f"protocol/{path.name} imports ..{module}, not a layer below it"
            )


#: Modules of the front end (DataLoader2): nothing in the engine or below may import them.
FRONT_END = {"reading_service", "trainer_graph"}
#: torchdata's DataLoader2 itself; the engine uses torchdata's graph utilities only.
DATALOADER2_MODULES = {"torchdata.dataloader2.dataloader2", "torchdata.dataloader2.reading_service"}


@pytest.mark.parametrize(
    "path",
    sorted([*(PACKAGE / "engine").glob("*.py"), PACKAGE / "config.py"]),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_the_engine_knows_no_dataloader2(path):
    for level, module, names in imports_of(path):
        first = module.split(".")[0]
        assert not (level and first in FRONT_END), f"{path.name} imports the front end ..{module}"
        assert module not in DATALOADER2_MODULES, f"{path.name} imports {module}"
        dataloader2 = {"DataLoader2", "ReadingServiceInterface"} & set(names)
        assert not (module == "torchdata.dataloader2" and dataloader2), f"{path.name} imports {dataloader2}"


#: The layers of DESIGN.md, lowest first, and the modules (or packages) of each. A module may
#: import modules of its own layer and of the layers below it; every module has a layer. The
#: foundation, below them all, holds what every layer uses: errors, names, settings, and the
#: look-up of worker addresses (which the engine and the worker server both need).
LAYERS = {
    "foundation": {
        "errors", "version", "safe_text", "quiet_imports", "settings", "addresses", "keys", "registry",
        "discovery",
    },
    "graph utilities": {"graph_utils", "seed_generator", "graph", "selection", "chunk_seeds", "sticky"},
    "serialization": {"serialization"},
    "protocol": {"protocol"},
    "transports": {"transports", "shared_items"},
    "session drivers": {"client", "receive_loop", "worker_session", "worker_inbox", "worker_outbox", "worker_cancel", "worker_lock_watch"},
    "worker server": {"worker", "cache", "metrics"},
    "engine": {"engine", "config", "distributions", "local_fleet", "checkpoint", "stats"},
    "front ends": {"reading_service", "trainer_graph", "frontends", "__init__"},
}
RANK = {module: rank for rank, modules in enumerate(LAYERS.values()) for module in modules}
LAYER_NAMES = list(LAYERS)


def package_relative(path: Path) -> List[str]:
    """The dotted parts of ``path``'s module below the package (``["engine", "run"]``)."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts


def imported_modules(path: Path):
    """The first part below the package of every module ``path`` imports from the package, at
    the top or inside a function (a lazy import still runs upward if it points up)."""
    package = list(path.relative_to(PACKAGE).parent.parts)
    for level, module, names in imports_of(path):
        if level == 0:
            parts = module.split(".")
            if parts[0] != "rpc_reading_service":
                continue
            target = parts[1:]
        else:
            target = package[: len(package) - (level - 1)] + (module.split(".") if module else [])
        if not target:  # ``from . import x`` in the package root, or ``import rpc_reading_service``
            target = [names[0]] if names else ["__init__"]
        yield target[0]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_only_go_down_the_layers(path):
    own = package_relative(path)[0]
    assert own in RANK, f"{path.relative_to(PACKAGE)} has no layer: add {own!r} to LAYERS"
    for target in imported_modules(path):
        if target == own:
            continue
        assert target in RANK, f"{path.relative_to(PACKAGE)} imports {target!r}, which has no layer in LAYERS"
        assert RANK[target] <= RANK[own], (
            f"{path.relative_to(PACKAGE)} ({LAYER_NAMES[RANK[own]]}) imports {target} "
            f"({LAYER_NAMES[RANK[target]]}), a layer above it: imports only go down (DESIGN.md)"
        )
