"""Cache keys: a stable hash of a namespace (which function) and an item's key (which input)."""

from __future__ import annotations

import functools
import hashlib
import pickle
from typing import Any, Callable

from ..errors import CacheKeyError, StickyKeyError
from ..sticky.hashing import encode_key

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
    """The hex blake2b hash of ``namespace`` and ``key``.

    str, bytes, int, float, None and tuples or lists of them are encoded canonically
    (:func:`~rpc_reading_service.sticky.hashing.encode_key`: equal keys give equal bytes,
    which a pickle does not promise, since its memo encodes a repeated object differently
    from an equal copy); other keys are pickled with protocol 5, so they must pickle to the
    same bytes in every process and run (sets and objects whose pickles vary do not).
    Raises :class:`~rpc_reading_service.errors.CacheKeyError` when a key can be neither.
    """
    try:
        encoded = b"k" + encode_key(key)
    except StickyKeyError:
        try:
            encoded = b"p" + pickle.dumps(key, protocol=5)
        except Exception as exc:  # noqa: BLE001 - pickling raises many types
            raise CacheKeyError(
                f"cached_map ({namespace.split('|')[0]}): the key {key!r:.80} cannot be pickled ({exc}); pass a "
                "key_fn that returns a str, bytes, int or tuple of them (e.g. the file path)"
            ) from exc
    digest = hashlib.blake2b(digest_size=20)
    name = namespace.encode("utf-8", "surrogatepass")
    digest.update(len(name).to_bytes(8, "big") + name)
    digest.update(encoded)
    return digest.hexdigest()
