"""The style rules of the package that a machine can check, on the source (``ast``, nothing imported)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set

PACKAGE = Path(__file__).resolve().parent.parent / "rpc_reading_service"
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def parsed_modules() -> Dict[Path, ast.Module]:
    """Every module of the package, parsed."""
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def base_names(cls: ast.ClassDef) -> List[str]:
    """The names the bases of ``cls`` go by (``Connection`` for ``base.Connection`` too)."""
    names = (base.id if isinstance(base, ast.Name) else getattr(base, "attr", None) for base in cls.bases)
    return [name for name in names if name]


def documented_methods(name: str, classes: Dict[str, List[ast.ClassDef]], seen: Set[str]) -> Set[str]:
    """The methods that the classes of the package called ``name``, or their bases, document."""
    if name in seen:
        return set()
    seen.add(name)
    documented: Set[str] = set()
    for cls in classes.get(name, []):
        documented |= {sub.name for sub in cls.body if isinstance(sub, FUNCTIONS) and ast.get_docstring(sub)}
        for base in base_names(cls):
            documented |= documented_methods(base, classes, seen)
    return documented


def undocumented_public_names() -> Iterator[str]:
    """``module:line name`` of every public module, class, function and method without a docstring.

    A method that overrides one a base class of the package documents counts as documented: its
    docstring is inherited (``help()``, ``inspect.getdoc`` and the docs show the base's)."""
    modules = parsed_modules()
    classes: Dict[str, List[ast.ClassDef]] = {}
    for tree in modules.values():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(node)
    for path, tree in modules.items():
        where = path.relative_to(PACKAGE.parent)
        if not ast.get_docstring(tree):
            yield f"{where}: the module"
        for node in tree.body:
            if not isinstance(node, (ast.ClassDef, *FUNCTIONS)) or node.name.startswith("_"):
                continue
            if not ast.get_docstring(node):
                yield f"{where}:{node.lineno} {node.name}"
            if not isinstance(node, ast.ClassDef):
                continue
            inherited = set().union(*(documented_methods(base, classes, set()) for base in base_names(node)))
            own = {sub.name for sub in node.body if isinstance(sub, FUNCTIONS) and ast.get_docstring(sub)}
            for sub in node.body:
                if isinstance(sub, FUNCTIONS) and not sub.name.startswith("_"):
                    if sub.name not in own | inherited:  # a property's setter shares its getter's
                        yield f"{where}:{sub.lineno} {node.name}.{sub.name}"


def test_every_public_name_says_what_it_is_for():
    missing = list(undocumented_public_names())
    assert missing == [], "public names without a docstring:\n" + "\n".join(missing)


def test_the_checker_sees_a_missing_docstring(tmp_path, monkeypatch):
    """The checker itself: it names an undocumented function, class, method and module, and
    accepts an override of a documented method."""
    package = tmp_path / "rpc_reading_service"
    package.mkdir()
    (package / "good.py").write_text(
        '"""Doc."""\nclass Base:\n    """Doc."""\n    def send(self):\n        """Doc."""\n'
        'class Child(Base):\n    """Doc."""\n    def send(self):\n        pass\n'
    )
    (package / "bad.py").write_text(
        "def helper():\n    pass\nclass Thing:\n    def run(self):\n        pass\n"
        "    def _private(self):\n        pass\n"
    )
    monkeypatch.setitem(globals(), "PACKAGE", package)
    assert sorted(undocumented_public_names()) == [
        "rpc_reading_service/bad.py: the module",
        "rpc_reading_service/bad.py:1 helper",
        "rpc_reading_service/bad.py:3 Thing",
        "rpc_reading_service/bad.py:4 Thing.run",
    ]
