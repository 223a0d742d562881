"""Distribution policies by name: the registry behind ``RPCReadingService(distribution=...)``.

Built in: ``"round_robin"`` (the default), ``"first_ready"``, ``"dynamic"`` and ``"sticky"`` (see
:mod:`rpc_reading_service.policies`). Third-party policies register with
:func:`register_distribution` or through the entry-point group
``rpc_reading_service.distributions`` (``name = "package.module:factory"``); a factory
takes keyword options and returns a
:class:`~rpc_reading_service.policies.base.DistributionPolicy`.
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
