"""``dp.cached_map(fn, key_fn=...)``: a map whose results the worker server keeps across epochs
and runs."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, Callable, Optional, TypeVar

from torch.utils.data import IterDataPipe, functional_datapipe

from .handle import worker_cache
from .keys import cache_key, function_namespace

__all__ = ["CachedMapperIterDataPipe"]

T = TypeVar("T")


@functional_datapipe("cached_map")
class CachedMapperIterDataPipe(IterDataPipe):
    """Apply ``fn`` to each item, through the worker server's cache (functional name ``cached_map``).

    Mark the expensive, deterministic step with it (read from storage, decode): on a hit the
    cached result is returned and ``fn`` is not called. Steps after it (random augmentations)
    run on every item as usual, so they stay random.

    Args:
        source_datapipe: The items.
        fn: The deterministic function to cache; its results must pickle (protocol 5; tensors do).
        key_fn: The item's cache key (default: the item itself). It must pickle to the same
            bytes in every process and run: str, bytes, int, float and tuples of them do.
        namespace: Added to the function's qualified name and code to tell caches apart; give
            one when results must change while ``fn``'s own code does not (partials of one
            function with other arguments, a changed helper that ``fn`` calls, other data
            behind the same keys).

    With no cache configured (a server without ``--cache-dir``/``--cache-memory``, or the graph
    running in the trainer), ``fn`` is simply called.
    """

    def __init__(
        self,
        source_datapipe: IterDataPipe,
        fn: Callable[[Any], T],
        key_fn: Optional[Callable[[Any], Any]] = None,
        namespace: str = "",
    ) -> None:
        if not callable(fn) or (key_fn is not None and not callable(key_fn)):
            raise TypeError(f"cached_map needs callable fn and key_fn, got {fn!r} and {key_fn!r}")
        self.source_datapipe = source_datapipe
        self.fn = fn
        self.key_fn = key_fn
        self.namespace = namespace

    def __iter__(self) -> Iterator[T]:
        cache = worker_cache()
        # Here, not in __init__: the code that runs is the worker's (a function it imports may differ).
        scope = function_namespace(self.fn, self.namespace) if cache is not None else ""
        for item in self.source_datapipe:
            if cache is None:
                yield self.fn(item)
                continue
            key = cache_key(scope, item if self.key_fn is None else self.key_fn(item))
            yield cache.get_or_compute(key, functools.partial(self.fn, item))

    def __len__(self) -> int:
        return len(self.source_datapipe)
