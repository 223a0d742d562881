"""Cache keys: a stable hash of a namespace (which function) and an item's key (which input)."""

from __future__ import annotations

import functools
import hashlib
import pickle
from typing import Any, Callable

from ..errors import CacheKeyError

__all__ = ["function_namespace", "cache_key"]


def function_namespace(fn: Callable[..., Any], namespace: str = "") -> str:
    """What tells ``fn``'s results apart from other functions' over one server: its module and
    qualified name (plus the line and a hash of the bytecode of a lambda, as all lambdas are
    called ``<lambda>``), the wrapped function of a ``functools.partial``, and the user's
    ``namespace``."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    if not hasattr(target, "__qualname__"):
        target = type(target)  # a callable object: its class
    name = f"{getattr(target, '__module__', '?')}.{target.__qualname__}"
    code = getattr(target, "__code__", None)
    if code is not None and target.__name__ == "<lambda>":
        consts = repr(
            [c for c in code.co_consts if not hasattr(c, "co_code")]
        )  # nested code reprs hold addresses
        digest = hashlib.blake2b(code.co_code + consts.encode(), digest_size=8).hexdigest()
        name += f"@{code.co_firstlineno}:{digest}"
    return f"{name}|{namespace}"


def cache_key(namespace: str, key: Any) -> str:
    """The hex blake2b hash of ``(namespace, key)`` pickled with protocol 5.

    ``key`` must pickle to the same bytes in every process and run: str, bytes, int, float,
    bool, None and tuples of them do; sets and objects whose pickles vary do not. Raises
    :class:`~rpc_reading_service.errors.CacheKeyError` when it cannot be pickled.
    """
    try:
        encoded = pickle.dumps((namespace, key), protocol=5)
    except Exception as exc:  # noqa: BLE001 - pickling raises many types
        raise CacheKeyError(
            f"cached_map ({namespace.split('|')[0]}): the key {key!r:.80} cannot be pickled ({exc}); pass a "
            "key_fn that returns a str, bytes, int or tuple of them (e.g. the file path)"
        ) from exc
    return hashlib.blake2b(encoded, digest_size=20).hexdigest()
