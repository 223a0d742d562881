"""Work distribution policies, and their registry by name (``RPCReadingService(distribution=...)``).

One package per policy: :mod:`.round_robin` (the default), :mod:`.first_ready`, :mod:`.dynamic`
(leased chunks, resequenced) and :mod:`.sticky` (by a stable hash of each item's key), each with
its trainer half (``trainer``: the policy and its merger) and, where it has one, its worker half
(``worker``: the selection that replaces ``sharding_filter``). :mod:`.base` is the interface,
:mod:`.merge` the merging of the workers' streams. Third-party policies register with
:func:`register_distribution` or the entry-point group ``rpc_reading_service.distributions``
(``name = "package.module:factory"``). No policy is imported here (they need torchdata).
"""

from __future__ import annotations

from typing import Any, Callable, List

from ..registry import Registry

__all__ = ["ENTRY_POINT_GROUP", "register_distribution", "available_distributions", "create_distribution"]

ENTRY_POINT_GROUP = "rpc_reading_service.distributions"
#: ``factory(**options) -> DistributionPolicy``.
DistributionFactory = Callable[..., Any]

_registry = Registry("distribution", ENTRY_POINT_GROUP)


def register_distribution(name: str, factory: DistributionFactory, *, replace: bool = False) -> None:
    """Make ``factory()`` available as ``RPCReadingService(distribution=name)``."""
    _registry.register(name, factory, replace=replace)


def available_distributions() -> List[str]:
    """Names of every registered distribution policy: built-in, registered and discovered."""
    return _registry.names()


def create_distribution(name: str, **options: Any) -> Any:
    """The policy registered under ``name``, built with ``options``; ConfigurationError if there is
    none or the factory does not return a DistributionPolicy."""
    from .base import DistributionPolicy

    return _registry.create(name, DistributionPolicy, **options)


_registry.register_builtin("round_robin", "rpc_reading_service.policies.round_robin.trainer:RoundRobin")
_registry.register_builtin("first_ready", "rpc_reading_service.policies.first_ready.trainer:FirstReady")
_registry.register_builtin("dynamic", "rpc_reading_service.policies.dynamic.trainer:Dynamic")
_registry.register_builtin("sticky", "rpc_reading_service.policies.sticky.trainer:Sticky")
