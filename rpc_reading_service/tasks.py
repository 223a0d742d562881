"""Threads with one owner each: a task group starts them, stops them and joins them (trio's nursery, for threads)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Callable, Iterable, List, Optional, Sequence, TypeVar

from .errors import thread_stack

__all__ = ["TaskGroup", "package_threads", "THREAD_PREFIX"]

log = logging.getLogger(__name__)

#: Every thread of the package has a name starting with this.
THREAD_PREFIX = "rrs-"

T = TypeVar("T")
R = TypeVar("R")


def package_threads() -> List[threading.Thread]:
    """The live threads of this process started by the package (named ``rrs-...``)."""
    return [thread for thread in threading.enumerate() if thread.name.startswith(THREAD_PREFIX) and thread.is_alive()]


class TaskGroup:
    """The threads of one owner: :meth:`start` them, :meth:`stop` them (stop event, bounded join).

    Args:
        owner: Whom the threads serve, for messages (``worker 1 (host:port)``, ``epoch 3``).
        daemon: The threads' default: daemon threads do not hold the interpreter's exit
            (docs/architecture.md, "Threads": when a thread may stay stuck in user code).
    """

    def __init__(self, owner: str = "", daemon: bool = True):
        self.owner = owner
        self.daemon = daemon
        #: Set by :meth:`stop`: the group's threads check it, or wait on it, and end.
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._threads: List[threading.Thread] = []
        #: Exceptions the threads' functions let out (logged; :meth:`raise_errors` raises the first).
        self.errors: List[BaseException] = []
        #: Threads :meth:`join` could not join in time, over the group's life (stuck in user code).
        self.left_behind = 0

    def start(self, name: str, fn: Callable[..., Any], *args: Any, daemon: Optional[bool] = None) -> threading.Thread:
        """Run ``fn(*args)`` in a new thread named ``rrs-NAME`` (``name`` says what and whom) and return it."""
        thread = threading.Thread(
            target=self._run, args=(fn, args), name=THREAD_PREFIX + name,
            daemon=self.daemon if daemon is None else daemon,
        )  # fmt: skip
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        try:
            thread.start()
        except BaseException:  # "can't start new thread": the caller hears of it
            with self._lock:
                self._threads.remove(thread)
            raise
        return thread

    def _run(self, fn: Callable[..., Any], args: Sequence[Any]) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - the owner hears of it (errors, raise_errors)
            log.error("thread %s of %s failed", threading.current_thread().name, self.owner or "the package", exc_info=exc)
            with self._lock:
                self.errors.append(exc)

    @property
    def threads(self) -> List[threading.Thread]:
        """The group's threads still alive."""
        with self._lock:
            return [thread for thread in self._threads if thread.is_alive()]

    def join(self, timeout: float, threads: Optional[Iterable[threading.Thread]] = None, report: bool = True) -> List[threading.Thread]:
        """Join the group's threads (or ``threads``), all within ``timeout`` s; return those still alive.

        With ``report``, each one left is counted in :attr:`left_behind` and logged with its stack.
        The calling thread is never joined (nor returned)."""
        deadline = time.monotonic() + max(0.0, timeout)
        current = threading.current_thread()
        chosen = self.threads if threads is None else [thread for thread in threads if thread.is_alive()]
        for thread in chosen:
            if thread is not current and thread.ident is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [thread for thread in chosen if thread is not current and thread.is_alive()]
        if not report:
            return stuck
        with self._lock:
            self.left_behind += len(stuck)
        for thread in stuck:
            log.warning(
                "thread %s of %s did not end within %.1f s and is left behind (daemon=%s); it is here:\n%s",
                thread.name, self.owner or "the package", timeout, thread.daemon, thread_stack(thread.ident),
            )  # fmt: skip
        return stuck

    def stop(self, timeout: float, report: bool = True) -> List[threading.Thread]:
        """Set :attr:`stopping`, join every thread within ``timeout`` s; return those left (see :meth:`join`)."""
        self.stopping.set()
        return self.join(timeout, report=report)

    def raise_errors(self) -> None:
        """Raise the first exception a thread's function let out (once), if one did."""
        with self._lock:
            errors, self.errors = self.errors, []
        if errors:
            raise errors[0]

    def map(self, name: str, fn: Callable[[T], R], items: Iterable[T], width: int) -> List[R]:
        """``[fn(item) for item in items]`` in up to ``width`` threads of the group; raises the first
        exception ``fn`` raised (after every item ran). An item not started when :attr:`stopping` is
        set is not run (its result is None)."""
        values = list(items)
        results: List[Any] = [None] * len(values)
        failures: List[BaseException] = []
        indices = iter(range(len(values)))
        lock = threading.Lock()

        def work() -> None:
            while not self.stopping.is_set():
                with lock:
                    index = next(indices, None)
                if index is None:
                    return
                try:
                    results[index] = fn(values[index])
                except BaseException as exc:  # noqa: BLE001 - raised to the caller below
                    failures.append(exc)

        threads = [self.start(f"{name}-{n}", work) for n in range(min(width, len(values)))]
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
        return results

    def start_each(self, name: str, fn: Callable[[T], Any], items: Iterable[T], width: int) -> List[threading.Thread]:
        """Run ``fn`` on every item in the background, in up to ``width`` threads of the group; an
        item not started when :attr:`stopping` is set never runs. Returns the threads."""
        values = list(items)
        indices = itertools.count()
        lock = threading.Lock()

        def work() -> None:
            while not self.stopping.is_set():
                with lock:
                    index = next(indices)
                if index >= len(values):
                    return
                fn(values[index])

        return [self.start(f"{name}-{n}", work) for n in range(min(width, len(values)))]

    def __enter__(self) -> "TaskGroup":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Stop and join the group (at most 5 s); then raise a thread's exception if none is in flight."""
        self.stop(5.0)
        if exc is None:
            self.raise_errors()
