"""One thread at a time in an iteration: the guard that refuses a second one at once."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, NoReturn, Optional

__all__ = ["IterationGuard"]


class IterationGuard:
    """Refuses a second thread that starts or steps an iteration while one thread is in one.

    A loader serves one iterator at a time but does not lock: two threads iterating one
    would share the workers' streams (one thread receiving both threads' items, the other
    waiting forever). Holding this guard while setting up an epoch and while taking each item
    makes the second thread fail at once instead. Sequential use from any number of threads
    (a new epoch after an abandoned one, an iterator handed to another thread) is not
    affected: the guard is only held inside those calls.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()  # reentrant: restoring a checkpoint sets up the workers too
        self.depth = 0  # only the holding thread touches it
        self.holder: Optional[int] = None  # its threading.get_ident()
        self.doing = ""

    def acquire(self, doing: str) -> None:
        """Take the guard for ``doing`` (e.g. ``"starting an epoch"``) or :meth:`refuse`."""
        if not self.lock.acquire(blocking=False):
            self.refuse(doing)
        self.depth += 1
        if self.depth == 1:
            self.holder, self.doing = threading.get_ident(), doing

    def release(self) -> None:
        """Give the guard back (the outermost release of a thread frees it)."""
        self.depth -= 1
        if self.depth == 0:
            self.holder = None
        self.lock.release()

    def refuse(self, doing: str) -> NoReturn:
        """Raise the ``RuntimeError`` that names both threads and what they are doing."""
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        raise RuntimeError(
            f"two threads use one DataLoader2 at once: thread {threading.current_thread().name!r} is {doing} "
            f"while thread {names.get(self.holder, '?')!r} is {self.doing}. A DataLoader2 serves one "
            "iteration at a time: give each thread its own DataLoader2, or share one iterator behind a lock"
        )

    @contextlib.contextmanager
    def held(self, doing: str) -> Iterator[None]:
        """Hold the guard for the ``with`` block."""
        self.acquire(doing)
        try:
            yield
        finally:
            self.release()
