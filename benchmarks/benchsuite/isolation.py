"""Fresh-process isolation: one task per forked child, in its own process group, with a
timeout; its result comes back over a pipe, and on exit, error, timeout or Ctrl-C the whole
group is killed and reaped."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

from benchsuite.processes import die_with_parent, kill_process_group, reap_adopted_children

Execute = Callable[[dict, Callable[[dict], None]], Any]

def describe_exception(exc: BaseException) -> str:
    """``Type: message`` on one line."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0] if text else type(exc).__name__


def _child_main(task: dict, execute: Execute, conn, log_path: Optional[str]) -> None:
    """Entry point of a forked child: new process group, quiet output, ``execute(task, emit)``,
    send its outcome."""
    # A process group of its own, not a session: with the kernel's CPU autogroups (on by
    # default) a new session is a scheduling group of its own, and the trainer would then get
    # as much CPU as all the running worker servers' sessions together, which no host with
    # its workers elsewhere (nor local workers, forked into the trainer's group) sees.
    os.setpgid(0, 0)
    die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch

    torch.set_num_threads(1)  # no OpenMP threads spinning in the trainer: it only moves data
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        outcome = {"ok": True, "data": execute(task, lambda point: conn.send({"partial": point}))}
    except BaseException as exc:
        outcome = {"ok": False, "reason": describe_exception(exc), "traceback": traceback.format_exc()}
    conn.send(outcome)
    conn.close()


def _tail(path: Optional[str], lines: int = 1) -> str:
    """The last non-empty lines of a log file."""
    if not path:
        return ""
    try:
        with open(path, errors="replace") as log:
            content = [line.rstrip() for line in log if line.strip()]
    except OSError:
        return ""
    return " | ".join(content[-lines:])


def wait_exit_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for child ``pid`` to exit, leaving it unreaped: while it
    is a zombie its pid, hence its process-group id, cannot be reused by anyone else."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def stop_child(proc: multiprocessing.process.BaseProcess, finished: bool) -> Optional[int]:
    """Let a child that sent its result exit by itself, then SIGTERM and SIGKILL what
    is left of its process group (MPRS workers, raw sender...); reap it, return its
    exit code."""
    if finished:
        wait_exit_unreaped(proc.pid, 3)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    wait_exit_unreaped(proc.pid, 3)
    kill_process_group(proc.pid)
    proc.join()
    return proc.exitcode


def run_task(task: dict, execute: Execute, timeout_s: float, verbose: bool = False,
             on_partial: Optional[Callable[[dict], None]] = None, keep: frozenset = frozenset()) -> dict:
    """Run ``execute(task, emit)`` in a forked child with a timeout; always kill and reap its
    processes (all but ``keep``, the long-lived servers).

    Returns ``{"ok": True, "data": ...}`` or ``{"ok": False, "reason": ...}``, plus
    ``"partial"`` (points the child reported before it finished) and ``"wall_s"``.
    """
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    log_fd, log_path = (None, None) if verbose else tempfile.mkstemp(prefix="bench-", suffix=".log")
    if log_fd is not None:
        os.close(log_fd)
    proc = context.Process(target=_child_main, args=(task, execute, sender, log_path), daemon=False)
    partial: list = []
    outcome: Optional[dict] = None
    t0 = time.monotonic()
    proc.start()
    sender.close()
    try:
        deadline = t0 + timeout_s
        while outcome is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                outcome = {"ok": False, "reason": f"timeout after {timeout_s:.0f} s"}
            elif receiver.poll(min(remaining, 0.5)):
                try:
                    message = receiver.recv()
                except EOFError:
                    outcome = {"ok": False, "reason": "child died", "died": True}
                    continue
                if "partial" in message:
                    partial.append(message["partial"])
                    if on_partial:
                        on_partial(message["partial"])
                else:
                    outcome = message
    finally:
        exit_code = stop_child(proc, finished=outcome is not None and "data" in outcome)
        reap_adopted_children(keep)
        receiver.close()
        if log_path:
            if outcome is not None and not outcome.get("ok"):
                outcome.setdefault("log_tail", _tail(log_path, 15))
                if outcome.pop("died", False):
                    tail = _tail(log_path)
                    outcome["reason"] = f"child died (exit code {exit_code})" + (f": {tail}" if tail else "")
            with contextlib.suppress(OSError):
                os.unlink(log_path)
    outcome["partial"] = partial
    outcome["wall_s"] = time.monotonic() - t0
    return outcome
