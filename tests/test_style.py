"""The docstring rules of the package that a machine can check, on the source (``ast``, nothing imported).

Docstrings are for the user's ``help()``: the public API (what ``rpc_reading_service/__init__.py``
exports, its methods and its modules) must have one; nothing else must, and no docstring is an
essay (reasons and designs go to ``docs/``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

PACKAGE = Path(__file__).resolve().parent.parent / "rpc_reading_service"
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
DEFINITIONS = (ast.ClassDef, *FUNCTIONS)
# the text before the Args / Returns / Raises section: one line plus a few, not an essay
MAX_PROSE_LINES = 12
SECTION = re.compile(r"\s*(Args|Arguments|Returns|Raises|Yields|Attributes|Example|Examples):\s*$")

# Essays written before the limit: trim each (move the reasons to docs/) and delete its line
# here. The package is being edited on other branches, so they are listed rather than cut now.
LONG_DOCSTRINGS_TO_TRIM = {
    "rpc_reading_service/protocol/session.py",
    "rpc_reading_service/trainer/receive_loop.py",
    "rpc_reading_service/trainer/channel.py",
    "rpc_reading_service/protocol/frames.py",
    "rpc_reading_service/protocol/messages.py",
}


def parsed_modules() -> Dict[Path, ast.Module]:
    """Every module of the package, parsed."""
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def where(path: Path) -> str:
    """``rpc_reading_service/x.py``, the way the lists above name a module."""
    return str(path.relative_to(PACKAGE.parent))


def exported_names(modules: Dict[Path, ast.Module]) -> List[str]:
    """The package's ``__all__``."""
    for node in modules[PACKAGE / "__init__.py"].body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


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


def undocumented_public_api() -> Iterator[str]:
    """``module:line name`` of every exported class or function without a docstring, of their
    public methods (an override of a method a base of the package documents inherits its
    docstring) and of the modules that define them."""
    modules = parsed_modules()
    classes: Dict[str, List[ast.ClassDef]] = {}
    definitions: Dict[str, List[Tuple[Path, ast.AST]]] = {}
    for path, tree in modules.items():
        for node in tree.body:
            if isinstance(node, DEFINITIONS):
                definitions.setdefault(node.name, []).append((path, node))
                if isinstance(node, ast.ClassDef):
                    classes.setdefault(node.name, []).append(node)
    if not ast.get_docstring(modules[PACKAGE / "__init__.py"]):
        yield f"{where(PACKAGE / '__init__.py')}: the module"
    modules_named: Set[Path] = set()
    for name in exported_names(modules):
        if name.startswith("__"):
            continue
        if name not in definitions:
            yield f"{name}: exported, but defined nowhere in the package"
        for path, node in definitions.get(name, []):
            if path not in modules_named and not ast.get_docstring(modules[path]):
                modules_named.add(path)
                yield f"{where(path)}: the module"
            if not ast.get_docstring(node):
                yield f"{where(path)}:{node.lineno} {name}"
            if not isinstance(node, ast.ClassDef):
                continue
            inherited = set().union(*(documented_methods(base, classes, set()) for base in base_names(node)))
            for sub in node.body:
                if isinstance(sub, FUNCTIONS) and not sub.name.startswith("_") and not ast.get_docstring(sub):
                    if sub.name not in inherited:
                        yield f"{where(path)}:{sub.lineno} {name}.{sub.name}"


def prose_lines(docstring: str) -> int:
    """How many lines a docstring has before its first Args / Returns / ... section."""
    lines = docstring.splitlines()
    for index, line in enumerate(lines):
        if SECTION.match(line):
            return index
    return len(lines)


def docstrings(path: Path, tree: ast.Module) -> Iterator[Tuple[str, str]]:
    """``(name, docstring)`` of the module and of every class and function in it, by qualified name."""
    if ast.get_docstring(tree):
        yield where(path), ast.get_docstring(tree) or ""

    def walk(node: ast.AST, prefix: str) -> Iterator[Tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, DEFINITIONS):
                qualified = f"{prefix}{child.name}"
                if ast.get_docstring(child):
                    yield f"{where(path)} {qualified}", ast.get_docstring(child) or ""
                yield from walk(child, qualified + ".")

    yield from walk(tree, "")


def long_docstrings() -> Dict[str, int]:
    """Every docstring whose prose runs over ``MAX_PROSE_LINES`` lines -> its length."""
    return {name: prose_lines(text) for path, tree in parsed_modules().items()
            for name, text in docstrings(path, tree) if prose_lines(text) > MAX_PROSE_LINES}


def test_the_public_api_says_what_it_is_for():
    missing = list(undocumented_public_api())
    assert missing == [], "public API without a docstring:\n" + "\n".join(missing)


def test_no_docstring_is_an_essay():
    essays = {name: length for name, length in long_docstrings().items() if name not in LONG_DOCSTRINGS_TO_TRIM}
    assert essays == {}, (f"docstrings of more than {MAX_PROSE_LINES} lines before their Args (one line plus "
                          f"arguments; reasons go to docs/):\n" + "\n".join(f"{k}: {v}" for k, v in essays.items()))


def test_the_list_of_essays_to_trim_only_shrinks():
    trimmed = LONG_DOCSTRINGS_TO_TRIM - set(long_docstrings())
    assert trimmed == set(), "trimmed (or gone): delete from LONG_DOCSTRINGS_TO_TRIM:\n" + "\n".join(sorted(trimmed))


def test_the_checkers_see_what_they_check(tmp_path, monkeypatch):
    """A missing docstring on an exported function, class, method and module is named, an
    override of a documented method and an unexported helper are not; an essay is named."""
    package = tmp_path / "rpc_reading_service"
    package.mkdir()
    (package / "__init__.py").write_text('"""Doc."""\n__all__ = ["__version__", "Child", "helper", "Thing"]\n')
    (package / "good.py").write_text(
        '"""Doc."""\nclass Base:\n    """Doc."""\n    def send(self):\n        """Doc."""\n'
        'class Child(Base):\n    """Doc."""\n    def send(self):\n        pass\n'
        "def unexported():\n    pass\n"
    )
    (package / "bad.py").write_text(
        "def helper():\n    pass\nclass Thing:\n    def run(self):\n        pass\n"
        "    def _private(self):\n        pass\n"
        'def essay():\n    """' + "line\n" * 13 + '\n    Args:\n' + "        x: y\n" * 20 + '    """\n'
        'def short():\n    """' + "line\n" * 12 + '    Args:\n' + "        x: y\n" * 20 + '    """\n'
    )
    monkeypatch.setitem(globals(), "PACKAGE", package)
    assert sorted(undocumented_public_api()) == [
        "rpc_reading_service/bad.py: the module",
        "rpc_reading_service/bad.py:1 helper",
        "rpc_reading_service/bad.py:3 Thing",
        "rpc_reading_service/bad.py:4 Thing.run",
    ]
    assert long_docstrings() == {"rpc_reading_service/bad.py essay": 14}
