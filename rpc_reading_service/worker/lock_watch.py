"""A session process whose interpreter lock stays held (C code stuck in an item) ends, its stack dumped.

While C code holds the interpreter lock no Python thread of the process runs: neither the
sender's heartbeats nor its item_timeout check. faulthandler's watchdog is a C thread that
needs no lock: :class:`LockWatch` re-arms it from a thread of its own every ``period``; held
past ``item_timeout`` plus :data:`MARGIN`, the lock keeps that thread from re-arming, and the
watchdog writes every thread's stack to :func:`stack_file` and ends the process. The server
logs that file when it reaps the process (:func:`take_stack`); the trainer sees the session
end then, not after its ``timeout``. faulthandler has one timer per process: forked sessions only.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import tempfile
import time
from typing import Optional

from ..tasks import TaskGroup

__all__ = ["LockWatch", "MARGIN", "stack_file", "take_stack", "timer_usable"]

#: Seconds past item_timeout the lock may stay held before the process ends (a loaded host may
#: not run the re-arming thread on time; the sender's own check fires at item_timeout).
MARGIN = 2.0


def stack_file(pid: int) -> str:
    """Where the session process ``pid`` dumps its stacks when its interpreter lock stays held."""
    return os.path.join(tempfile.gettempdir(), f"rrs-session-{pid}.stuck")


def take_stack(pid: int) -> Optional[str]:
    """The stacks the ended session process ``pid`` dumped (None: it dumped none); removes the file."""
    path = stack_file(pid)
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            text = file.read()
    except FileNotFoundError:
        return None
    with contextlib.suppress(OSError):
        os.unlink(path)
    return text or None


def timer_usable(wait: float = 0.5) -> bool:
    """Whether faulthandler's timer works in this process (False: :class:`LockWatch` would hang it).

    A process forked while its parent's timer was armed (a trainer's own
    ``faulthandler.dump_traceback_later``) inherits the timer as running without its thread:
    arming or cancelling it there waits for that thread forever, holding the interpreter lock.
    So a forked child of this process tries, and is killed if it has not ended within ``wait``.

    Args:
        wait: Seconds to give the probe.
    """
    pid = os.fork()
    if pid == 0:  # the probe
        faulthandler.cancel_dump_traceback_later()
        os._exit(0)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return True
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False


class LockWatch:
    """Ends this process, its stacks dumped, when the interpreter lock stays held ``item_timeout + MARGIN`` s.

    Args:
        item_timeout: The session's item_timeout (seconds).
    """

    def __init__(self, item_timeout: float):
        self._timeout = item_timeout + MARGIN
        self._period = min(1.0, item_timeout / 4)
        self._path = stack_file(os.getpid())
        self._file = open(self._path, "w", encoding="utf-8")  # noqa: SIM115 - open until stop()
        # Not a daemon: it runs no user code, and the session's end always stops it.
        self._tasks = TaskGroup(f"the session process {os.getpid()}", daemon=False)

    def start(self) -> None:
        """Arm the watchdog and start re-arming it."""
        faulthandler.dump_traceback_later(self._timeout, exit=True, file=self._file)
        self._tasks.start("lock-watch", self._rearm)

    def _rearm(self) -> None:
        while not self._tasks.stopping.wait(self._period):
            faulthandler.dump_traceback_later(self._timeout, exit=True, file=self._file)

    def stop(self) -> None:
        """Disarm the watchdog and remove the (empty) stack file."""
        self._tasks.stop(2 * self._period + 1.0)
        faulthandler.cancel_dump_traceback_later()
        self._file.close()
        with contextlib.suppress(OSError):
            os.unlink(self._path)
