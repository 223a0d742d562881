"""Cache keys: a stable hash of a namespace (which function) and an item's key (which input)."""

from __future__ import annotations

import functools
import hashlib
import pickle
import types
from typing import Any, Callable

from ..errors import CacheKeyError, StickyKeyError
from ..stable_keys import encode_key

__all__ = ["function_namespace", "cache_key"]


def function_namespace(fn: Callable[..., Any], namespace: str = "") -> str:
    """What tells ``fn``'s results apart from other functions' over one server: its module and
    qualified name, a hash of its code (its own body, not the functions it calls; plus the line
    of a lambda, as all lambdas are called ``<lambda>``), the wrapped function of a
    ``functools.partial`` (not its arguments), and the user's ``namespace``.

    Args:
        fn: The function ``cached_map`` applies (a function, lambda, method, partial or callable object).
        namespace: The user's ``namespace=``.
    """
    target = fn.func if isinstance(fn, functools.partial) else fn
    if not hasattr(target, "__qualname__"):
        target = type(target)  # a callable object: its class, and the code of its __call__
    name = f"{getattr(target, '__module__', '?')}.{target.__qualname__}"
    code = getattr(target, "__code__", None) or getattr(getattr(target, "__call__", None), "__code__", None)
    if isinstance(code, types.CodeType):
        digest = hashlib.blake2b(digest_size=8)
        _hash_code(digest, code)
        line = f"{code.co_firstlineno}:" if getattr(target, "__name__", None) == "<lambda>" else ""
        name += f"@{line}{digest.hexdigest()}"
    return f"{name}|{namespace}"


def _hash_code(digest: Any, code: types.CodeType) -> None:
    """Feed what ``code`` does to ``digest``: its bytecode, the names it uses and its constants,
    nested functions' code included, in a form that is the same in every process (a repr of a
    code object holds its address; a frozenset's order of strings varies with the hash seed).

    Args:
        digest: A hashlib object.
        code: The code object.
    """
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode("utf-8", "surrogatepass"))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _hash_code(digest, const)
        else:
            digest.update(_stable_repr(const).encode("utf-8", "surrogatepass"))


def _stable_repr(const: Any) -> str:
    if isinstance(const, frozenset):
        return "frozenset(" + ",".join(sorted(_stable_repr(c) for c in const)) + ")"
    if isinstance(const, tuple):
        return "(" + ",".join(_stable_repr(c) for c in const) + ")"
    return f"{type(const).__name__}:{const!r}"


def cache_key(namespace: str, key: Any) -> str:
    """The hex blake2b hash of ``namespace`` and ``key``.

    str, bytes, int, float, None and tuples or lists of them are encoded canonically
    (:func:`~rpc_reading_service.stable_keys.encode_key`: equal keys give equal bytes,
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
