"""A registry of named factories that also finds installed plugins by entry point.

Transports and distribution policies are pluggable the same way: built-ins and
``register_*()`` calls by name, and installed packages through an entry-point group
(``name = "package.module:factory"``), loaded on first use. Built-ins and explicit
registrations win over entry points of the same name (installed metadata may name a
module that moved).
"""

from __future__ import annotations

import pkgutil
import sys
import threading
from typing import Any, Callable, Dict, List

from .errors import ConfigurationError

__all__ = ["Registry"]


class Registry:
    """Factories by name for one kind of plugin (``kind`` names it in errors).

    Args:
        kind: What is registered, for messages (``"transport"``).
        entry_point_group: The entry-point group installed plugins use.
    """

    def __init__(self, kind: str, entry_point_group: str):
        self.kind = kind
        self.entry_point_group = entry_point_group
        self.factories: Dict[str, Callable[..., Any]] = {}
        self.entry_points_loaded = False
        self._lock = threading.Lock()

    def register(self, name: str, factory: Callable[..., Any], *, replace: bool = False) -> None:
        """Make ``factory`` available under ``name``; refuse to replace another one unless ``replace``."""
        if not name or not isinstance(name, str):
            raise ConfigurationError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if not callable(factory):
            raise ConfigurationError(f"the factory of {self.kind} {name!r} must be callable, got {factory!r}")
        with self._lock:
            if name in self.factories and not replace and self.factories[name] is not factory:
                raise ConfigurationError(
                    f"{self.kind} {name!r} is already registered; pass replace=True to override it"
                )
            self.factories[name] = factory

    def register_builtin(self, name: str, target: str) -> None:
        """Register the factory at ``target`` (``"package.module:attribute"``, as an entry point
        names it) under ``name``, imported on first use: a built-in costs no import (of torch,
        say) until it is chosen."""
        self.register(name, _loading_factory(lambda: pkgutil.resolve_name(target)))

    def entry_points(self) -> list:
        """The installed entry points of the group."""
        from importlib import metadata

        if sys.version_info >= (3, 10):
            return list(metadata.entry_points(group=self.entry_point_group))
        return list(metadata.entry_points().get(self.entry_point_group, []))  # pragma: no cover - Python 3.9

    def _load_entry_points(self) -> None:
        if self.entry_points_loaded:
            return
        self.entry_points_loaded = True
        for entry_point in self.entry_points():
            if entry_point.name in self.factories:
                continue  # built-ins and explicit registrations win
            self.factories[entry_point.name] = _loading_factory(entry_point.load)

    def names(self) -> List[str]:
        """Every registered name: built-in, registered and discovered by entry point."""
        with self._lock:
            self._load_entry_points()
            return sorted(self.factories)

    def factory(self, name: str) -> Callable[..., Any]:
        """The factory registered under ``name``; ConfigurationError listing the others if none is."""
        names = self.names()
        factory = self.factories.get(name)
        if factory is None:
            raise ConfigurationError(f"unknown {self.kind} {name!r}; available {self.kind}s: {', '.join(names)}")
        return factory

    def create(self, name: str, expected: type, **options: Any) -> Any:
        """``factory(**options)`` of the factory registered under ``name``; ConfigurationError if
        it takes none of these options or returns no ``expected``."""
        factory = self.factory(name)
        try:
            made = factory(**options)
        except TypeError as exc:
            if not options:
                raise
            raise ConfigurationError(
                f"{self.kind} {name!r} does not accept the options {sorted(options)}: {exc}"
            ) from exc
        if not isinstance(made, expected):
            raise ConfigurationError(
                f"{self.kind} factory for {name!r} returned {type(made).__name__}, not a {expected.__name__}"
            )
        return made


def _loading_factory(load: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
    """A factory that calls ``load()`` (an import) each time it is called, and what it returns."""

    def factory(**options: Any) -> Any:
        return load()(**options)

    return factory
