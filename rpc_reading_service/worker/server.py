"""The worker server: ``rpc-reading-worker`` / ``python -m rpc_reading_service.worker``.

It accepts authenticated trainer connections and runs each session in isolation. On
POSIX each session gets its own forked process (torch and torchdata are imported
before the fork, so a session starts in milliseconds, and a crash, ``os._exit`` or
segfault in a user's graph ends only that session); elsewhere sessions run in threads.

SIGTERM drains it: no new sessions, each session tells its trainer it leaves (LEAVING) and
ends, and the server exits 0 once they have, or after ``--drain-timeout`` seconds (stopping
the rest). A second SIGTERM, or SIGINT, stops it at once.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Union

from ..version import __version__
from ..addresses import is_loopback_host
from ..cache.config import CacheConfig
from ..cache.handle import set_worker_cache
from ..cache.temporary import HeldDirectory
from ..discovery import WorkerRegistration, advertised_address
from ..errors import ConfigurationError
from ..keys import AUTH_KEY_ENV, load_auth_key
from ..metrics.counters import SessionCounters, SessionLedger
from ..protocol import DEFAULT_MAX_FRAME_BYTES
from ..protocol.messages import resolve_field_types
from ..transports import available_transports, create_transport
from ..transports.base import Connection, Listener
from .heap import keep_freed_heap
from .lock_watch import take_stack

from ..quiet_imports import torchdata_banner_muted
from ..tasks import TaskGroup

with torchdata_banner_muted():  # the session code imports torchdata's datapipes
    from ..graph import warm_up_worker_graph_utilities  # noqa: E402
    from .session import WorkerSession  # noqa: E402

__all__ = ["WorkerServer", "build_parser", "die_with_parent", "main"]

log = logging.getLogger("rpc_reading_service.worker")


class WorkerServer:
    """Accepts trainer sessions and runs each one in its own process (or thread)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        auth_key: bytes = b"",
        transport: str = "socket",
        session_mode: Optional[str] = None,
        parent_pid: Optional[int] = None,
        handshake_timeout: float = 10.0,
        tls_cert: Optional[str] = None,
        tls_key: Optional[str] = None,
        max_frame_bytes: Optional[int] = None,
        max_sessions: Optional[int] = None,
        idle_timeout: float = 60.0,
        stats_interval: float = 30.0,
        cache: Optional[CacheConfig] = None,
        drain_timeout: float = 30.0,
        lock_watch: bool = True,
    ):
        """``tls_cert``/``tls_key``: serve TLS. ``max_frame_bytes``: refuse larger frames from
        trainers. ``max_sessions``: refuse sessions beyond this many at once. ``idle_timeout``:
        seconds an authenticated trainer may stay silent before sending SETUP. ``stats_interval``:
        seconds between each session's throughput log lines (0 turns them off). ``cache``: the
        worker cache every session's ``cached_map`` shares (None: ``cached_map`` just calls fn).
        ``drain_timeout``: seconds a drain (:meth:`drain`) waits for the sessions to leave. ``lock_watch``:
        with item_timeout, forked sessions stuck in C code end (False where faulthandler's timer hangs)."""
        if not auth_key and not is_loopback_host(host):
            raise ConfigurationError(
                f"refusing to listen on {host} without an auth key: anyone who can reach the port could run "
                f"code here. Pass --auth-key-file FILE or set {AUTH_KEY_ENV}, or listen on 127.0.0.1"
            )
        if max_sessions is not None and max_sessions < 1:
            raise ConfigurationError(f"--max-sessions must be at least 1, got {max_sessions}")
        if idle_timeout <= 0 or handshake_timeout <= 0:
            raise ConfigurationError("--idle-timeout and --handshake-timeout must be positive")
        if not drain_timeout >= 0:
            raise ConfigurationError(f"--drain-timeout must be 0 or more seconds, got {drain_timeout}")
        self.drain_timeout = drain_timeout
        self.lock_watch = lock_watch
        #: Set by :meth:`drain` (a signal handler): a plain flag, read by the accept loop and sessions.
        self.draining = False
        options: Dict[str, Any] = {}
        if tls_cert is not None or tls_key is not None:
            options.update(tls_cert=tls_cert, tls_key=tls_key)
        if max_frame_bytes is not None:
            options["max_frame_bytes"] = max_frame_bytes
        self._transport = create_transport(transport, **options)
        self.tls = tls_cert is not None
        self.max_sessions = max_sessions
        self.idle_timeout = idle_timeout
        self.stats_interval = stats_interval
        if session_mode is None:
            session_mode = "fork" if self._transport.supports_fork and hasattr(os, "fork") else "thread"
        if session_mode == "fork" and not (self._transport.supports_fork and hasattr(os, "fork")):
            raise ConfigurationError(f"transport {transport!r} cannot hand sessions to forked processes; use --session-mode thread")
        self.session_mode = session_mode
        self._listener: Listener = self._transport.listen(host, port, auth_key, handshake_timeout)
        self.address = self._listener.address
        if max_sessions is not None:
            self._listener.admit = self._admit
        self._parent_pid = parent_pid
        self._children: Dict[int, str] = {}
        #: The read end of each session process's pipe for the stacks faulthandler writes on a fatal signal.
        self._crash_pipes: Dict[int, int] = {}
        self._terminated: Set[int] = set()  # sessions this server SIGTERMed itself, when shutting down
        #: Sessions in thread mode, and their connections (closed at shutdown, which ends them).
        self._sessions = TaskGroup(f"the worker server at {self.address}")
        self._session_conns: Dict[threading.Thread, Connection] = {}
        self._stop = threading.Event()
        self._wake_fds: List[int] = []  # wake_on()'s pipe end: sessions close it
        self._cache = cache
        #: Holds a temporary cache directory in use while this server runs (see cache/temporary.py).
        self._cache_hold: Optional[HeldDirectory] = None
        if cache is not None and cache.temporary and cache.directory:
            self._cache_hold = HeldDirectory(cache.directory)
        #: Sessions and their counters, for metrics (``--metrics-port``).
        self.ledger = SessionLedger()
        set_worker_cache(cache)  # before any session forks, so every session finds it

    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return (safe from signal handlers and other threads)."""
        self._stop.set()

    def drain(self) -> None:
        """Ask :meth:`serve_forever` to drain, then return (safe from signal handlers): no new
        sessions, every session tells its trainer it leaves, at most ``drain_timeout`` seconds.
        In a session's own process: that session leaves."""
        self.draining = True

    def wake_on(self, fd: int) -> None:
        """Have the accept loop wake as soon as ``fd`` (a non-blocking pipe's read end) turns readable.

        Args:
            fd: The read end of the pipe given to ``signal.set_wakeup_fd``.
        """
        self._wake_fds.append(fd)
        if not self._listener.wake_on(fd):
            log.debug("listener %s cannot wake on a pipe: stop requests wait for its accept timeout", self.address)

    def prepare_to_fork(self) -> None:
        """Make forked sessions cheap; call once before serving (before the address is announced).

        A session's first epoch used to cost about 30 ms of CPU for what every session does
        alike: torchdata's first traversal and seeding of a graph, numpy.random's lazy import,
        torch's first seeding (which reads source lines for a CUDA traceback), abc caches, the
        protocol's field types.
        Done once here, every fork inherits it. Then ``gc.freeze()``: the collector no longer
        walks (so writes to) the objects inherited from this process, which keeps sessions
        from copying the server's heap page by page (copy-on-write). No ``gc.collect()``
        first: with torch imported it costs ~100 ms of CPU, before the first session can fork.
        """
        warm_up_worker_graph_utilities()
        resolve_field_types()
        gc.freeze()

    def serve_forever(self) -> None:
        """Accept and serve sessions until :meth:`stop` (or the parent process is gone)."""
        log.info(
            "serving on %s (transport %s%s, sessions in %s mode%s)", self.address, self._transport.name,
            ", TLS" if self.tls else "", self.session_mode,
            f", at most {self.max_sessions}" if self.max_sessions else "",
        )  # fmt: skip
        try:
            while not self._stop.is_set():
                if self.draining:
                    if self.drain_timeout > 0:  # 0: stop at once, as a second signal does
                        self._drain()
                    break
                conn = self._listener.accept(timeout=0.5)
                self._reap()
                if self._parent_pid is not None and os.getppid() != self._parent_pid:
                    log.warning("parent process %d is gone; shutting down", self._parent_pid)
                    break
                if conn is not None:
                    refusal = None if self._listener.supports_admission else self._refusal()
                    if refusal is not None:  # a listener that cannot refuse during its handshake
                        log.warning("refused a session to %s: %s", conn.peer, refusal)
                        conn.close()
                        continue
                    self._start_session(conn)
        finally:
            self._shutdown()

    def active_sessions(self) -> int:
        """Sessions running now (reaps finished ones first)."""
        self._reap()
        return len(self._children) + len(self._sessions.threads)

    def _refusal(self) -> Optional[str]:
        if self.max_sessions is None:
            return None
        active = self.active_sessions() + self._listener.queued()
        if active < self.max_sessions:
            return None
        return (
            f"it already serves {active} session{'s' if active != 1 else ''} (--max-sessions {self.max_sessions}); "
            "retry when a session ends, or add workers"
        )

    def _admit(self, peer: str) -> Optional[str]:
        """The listener asks before welcoming an authenticated peer; a reason refuses it."""
        return self._refusal()

    def _start_session(self, conn: Connection) -> None:
        """Run ``conn``'s session in a new process (or thread); if the host cannot start one
        (a process limit, out of memory), refuse only this session and say why."""
        counters = self.ledger.begin()
        if self.session_mode == "thread":
            try:
                thread = self._sessions.start(f"session-{conn.peer}", self._run_thread_session, conn, counters)
            except RuntimeError as exc:  # "can't start new thread"
                self.ledger.end(counters)
                self._refuse_session(conn, f"cannot start a thread: {exc}")
                return
            alive = self._sessions.threads
            self._session_conns = {t: c for t, c in self._session_conns.items() if t in alive}
            self._session_conns[thread] = conn
            return
        _flush_lines()
        inherited = [*self._listener.inheritable_fds(), *self._wake_fds, *self._crash_pipes.values()]
        # Non-blocking: a dump larger than the pipe is cut short, never a hang of the dying process.
        crash_read, crash_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # A stop signal waits until both sides are past the fork (and its at-fork hooks): the
        # server's handler only sets a flag; in the session, it acts with the default action.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, (*STOP_SIGNALS, DRAIN_SESSION_SIGNAL))
        server_pid = os.getpid()
        try:
            pid = os.fork()
        except OSError as exc:  # BlockingIOError (EAGAIN) at a pids limit, ENOMEM
            self.ledger.end(counters)
            os.close(crash_read)
            os.close(crash_write)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            self._refuse_session(conn, f"fork failed: {exc}")
            return
        if pid == 0:  # the session process
            code = 0
            try:
                faulthandler.enable(crash_write, all_threads=True)  # every thread's stack, for the server to log
                inherited.append(crash_read)
                for signum in STOP_SIGNALS:
                    signal.signal(signum, signal.SIG_DFL)
                signal.signal(DRAIN_SESSION_SIGNAL, lambda _signum, _frame: self.drain())  # this session leaves
                if self._parent_pid is not None and die_with_parent(signal.SIGKILL) and os.getppid() != server_pid:
                    os._exit(1)  # a trainer's own server: its sessions end with it, however it ended
                wakeup = signal.set_wakeup_fd(-1)  # the server's self-pipe: not this process's
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                for fd in inherited + ([wakeup] if wakeup >= 0 else []):
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                self._run_session(conn, counters, own_process=True)
            except BaseException:  # noqa: BLE001
                code = 1
            finally:
                logging.shutdown()
                _flush_lines()
                os._exit(code)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(crash_write)
        conn.release()
        self._children[pid] = conn.peer
        self._crash_pipes[pid] = crash_read
        self.ledger.forked(pid, counters)
        log.info("session for %s runs in process %d", conn.peer, pid)

    def _refuse_session(self, conn: Connection, failure: str) -> None:
        reason = (
            f"server cannot start a session: {failure}. This worker host is at a process or memory limit (a "
            f"container's pids limit, `ulimit -u`); its {self.active_sessions()} running sessions go on. Raise the "
            "limit, start the server with a lower --max-sessions, or retry when a session ends"
        )
        log.error("refused a session to %s: %s", conn.peer, reason)
        conn.refuse(reason)  # without lingering: other trainers wait on this loop

    def _run_thread_session(self, conn: Connection, counters: SessionCounters) -> None:
        try:
            self._run_session(conn, counters)
        finally:
            self.ledger.end(counters)

    def _run_session(
        self, conn: Connection, counters: Optional[SessionCounters] = None, own_process: bool = False
    ) -> None:
        try:
            import torch

            torch.set_num_threads(1)  # one core per session, as torch's own DataLoader workers do
        except Exception:  # noqa: BLE001
            pass
        if own_process:
            keep_freed_heap()  # the process is this session's alone: see docs/architecture.md, "The worker's heap"
        WorkerSession(
            conn,
            self.address,
            idle_timeout=self.idle_timeout,
            stats_interval=self.stats_interval,
            counters=counters,
            own_process=own_process,
            draining=lambda: self.draining,
            lock_watch=self.lock_watch,
        ).run()

    def _reap(self) -> None:
        for pid in list(self._children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                peer = self._children.pop(pid)
                self.ledger.process_ended(pid)
                stack, crash = take_stack(pid), self._take_crash_stack(pid)
                if stack is not None:
                    log.warning(
                        "session process %d for %s ended: C code held its interpreter lock for more than item_timeout "
                        "(no thread could run, nor send heartbeats). Its threads were here:\n%s", pid, peer, stack,
                    )  # fmt: skip
                if os.WIFSIGNALED(status) and not (pid in self._terminated and os.WTERMSIG(status) == signal.SIGTERM):
                    log.warning(
                        "session process %d for %s was killed by signal %d (%s)%s", pid, peer, os.WTERMSIG(status),
                        _signal_name(os.WTERMSIG(status)), f". Its threads were here:\n{crash}" if crash else "",
                    )  # fmt: skip
                elif os.WIFSIGNALED(status):
                    log.debug("session process %d for %s ended on this server's SIGTERM", pid, peer)
                else:
                    log.info("session process %d for %s ended", pid, peer)

    def _take_crash_stack(self, pid: int) -> str:
        """What the ended session process ``pid`` wrote on a fatal signal ("": nothing); closes its pipe."""
        fd = self._crash_pipes.pop(pid, None)
        if fd is None:
            return ""
        chunks = []
        try:
            while True:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError:  # BlockingIOError: all read (a process the session forked holds the write end)
            pass
        finally:
            os.close(fd)
        return b"".join(chunks).decode("utf-8", errors="replace").rstrip()

    def _drain(self) -> None:
        """Stop accepting, ask every session to leave, and wait up to ``drain_timeout`` for them
        (a second stop signal ends the wait); :meth:`_shutdown` stops the rest."""
        self._listener.close()  # a trainer connecting now finds the port closed
        sessions = self.active_sessions()
        log.info(
            "draining: no new sessions; asking %d session%s to leave (at most %g s, --drain-timeout)",
            sessions, "" if sessions == 1 else "s", self.drain_timeout,
        )  # fmt: skip
        for pid in self._children:  # thread sessions read self.draining themselves
            try:
                os.kill(pid, DRAIN_SESSION_SIGNAL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.drain_timeout
        while self.active_sessions() and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.02)  # not Event.wait: a signal handler sets the event in this thread
        left = self.active_sessions()
        if not left:
            log.info("drained: every session has ended")
        elif self._stop.is_set():
            log.warning("a second stop signal while draining: stopping the %d sessions left now", left)
        else:
            log.warning("drain: %d session(s) still running after %g s (--drain-timeout); stopping them", left, self.drain_timeout)

    def _shutdown(self) -> None:
        self._listener.close()
        for pid in self._children:
            try:
                self._terminated.add(pid)
                os.kill(pid, signal.SIGTERM)
                # A stopped (SIGSTOP) session acts on SIGTERM only once continued; without
                # this, shutting down waited the full 3 s below for it.
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 3.0
        self._reap()  # sessions that ended on their trainer's CLOSE: no wait at all
        while self._children and time.monotonic() < deadline:
            time.sleep(0.02)
            self._reap()
        for pid in list(self._children):
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            self._children.pop(pid, None)
            self._take_crash_stack(pid)  # closes its pipe: killed here, nothing to say
        for conn in self._session_conns.values():  # thread sessions: a closed connection ends each one
            conn.close()
        self._sessions.stop(max(0.0, deadline - time.monotonic()) + 1.0)
        if self._cache_hold is not None:  # a temporary cache: removed, then let go
            self._cache_hold.remove()
            self._cache_hold = None


def die_with_parent(signum: int) -> bool:
    """Have the kernel send this process ``signum`` when the thread that forked it ends (Linux's
    ``PR_SET_PDEATHSIG``, whatever this process is doing then); False where it cannot.

    Args:
        signum: The signal to receive (its default action, or this process's handler, applies).
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


_PR_SET_PDEATHSIG = 1


def _signal_name(signum: int) -> str:
    """``SIGSEGV`` for 11; the number for a signal this platform does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _flush_lines() -> None:
    """Flush stdout/stderr (so a fork does not copy their buffers) and make them line-buffered:
    a session ends in ``os._exit`` or SIGTERM, which would drop what its graph printed into a
    block buffer, and whole lines keep the output of sessions sharing one stream readable."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        except (AttributeError, OSError, ValueError):
            pass


#: The signals that stop a worker server (and end a session process by their default action).
#: SIGTERM drains first (:meth:`WorkerServer.drain`); a second one, or SIGINT, stops at once.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: What the server sends a session process to make it leave (drain).
DRAIN_SESSION_SIGNAL = signal.SIGUSR1


def serve_until_signalled(server: Union["WorkerServer", Dict[str, Any]], announce: Callable[[str], Any]) -> int:
    """Serve until SIGTERM (which drains: a second one stops at once) or SIGINT (stops at once);
    ``announce("listening on ADDRESS")`` once ready.

    ``server`` is a :class:`WorkerServer` or the keyword arguments to build one (a
    :class:`~rpc_reading_service.errors.ConfigurationError` then propagates). Returns 0.
    """
    if isinstance(server, dict):
        server = WorkerServer(**server)
    if server.session_mode == "fork":
        server.prepare_to_fork()
    running = server

    def stop_now(signum: int, _frame: object) -> None:
        # Only flags, never an exception: the wake-up pipe wakes the accept loop.
        if signum == signal.SIGTERM and not running.draining:
            running.drain()
        else:
            running.stop()

    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    previous = signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    try:
        server.wake_on(wake_read)
        for signum in STOP_SIGNALS:
            signal.signal(signum, stop_now)  # stays: a signal while shutting down (not draining) is ignored
        announce(f"listening on {server.address}")
        server.serve_forever()
    finally:
        signal.set_wakeup_fd(previous)
        os.close(wake_read)
        os.close(wake_write)
    return 0


def _cache_config(args: argparse.Namespace) -> Optional[CacheConfig]:
    cache = CacheConfig.create(args.cache_dir, args.cache_size, args.cache_memory)
    if cache is not None and args.cache_dir_temporary:
        cache = dataclasses.replace(cache, temporary=True)
    return cache


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``rpc-reading-worker``."""
    parser = argparse.ArgumentParser(
        prog="rpc-reading-worker",
        description="Serve DataPipe graphs to RPCReadingService trainers.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=29600, help="port to listen on; 0 picks a free one (default 29600)")
    parser.add_argument("--auth-key-file", help=f"file holding the shared auth key (else ${AUTH_KEY_ENV})")
    parser.add_argument("--transport", default="socket", help="transport: one of the registered names (default socket)")
    parser.add_argument("--session-mode", choices=["fork", "thread"], help="run sessions in forked processes or threads")
    parser.add_argument("--handshake-timeout", type=float, default=10.0, help="seconds a peer has to authenticate (default 10)")
    parser.add_argument(
        "--idle-timeout", type=float, default=60.0,
        help="seconds an authenticated trainer may stay silent before setting up its session (default 60); "
        "after that the trainer's own timeout applies (its heartbeats keep a session alive)",
    )  # fmt: skip
    parser.add_argument(
        "--stats-interval", type=float, default=30.0, metavar="SECONDS",
        help="log each session's throughput (items/s, MB/s, time waiting for trainer credit) this often "
        "(default 30; 0 turns it off)",
    )  # fmt: skip
    parser.add_argument(
        "--drain-timeout", type=float, default=30.0, metavar="SECONDS",
        help="on SIGTERM, stop accepting sessions, tell each trainer this worker leaves (they go on without "
        "it) and wait at most this long for the sessions to end before stopping them (default 30; 0: stop at "
        "once); a second SIGTERM, or SIGINT, stops at once",
    )  # fmt: skip
    parser.add_argument(
        "--max-sessions", type=int, metavar="N",
        help="serve at most N sessions at once; more are refused with a clear error (default: no limit)",
    )  # fmt: skip
    parser.add_argument(
        "--max-frame-bytes", type=int, metavar="BYTES",
        help=f"refuse frames from trainers larger than this, unread (default {DEFAULT_MAX_FRAME_BYTES})",
    )  # fmt: skip
    parser.add_argument(
        "--cache-dir", metavar="DIR",
        help="cache cached_map results in DIR, shared by all sessions, kept across runs (needs --cache-size)",
    )  # fmt: skip
    parser.add_argument(
        "--cache-size", metavar="BYTES",
        help="bound of --cache-dir, e.g. 500M or 20G; least recently used entries go first",
    )  # fmt: skip
    parser.add_argument(
        "--cache-memory", metavar="BYTES",
        help="also keep up to BYTES of cached_map results in each session's memory (default 0: none)",
    )  # fmt: skip
    parser.add_argument("--cache-dir-temporary", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tls-cert", metavar="FILE", help="serve TLS with this certificate (chain), PEM")
    parser.add_argument("--tls-key", metavar="FILE", help="private key of --tls-cert, PEM (if not in the same file)")
    parser.add_argument(
        "--store", metavar="HOST:PORT",
        help="register this worker in the torch.distributed TCPStore at HOST:PORT, for "
        "RPCReadingService(workers=StoreDiscovery(...)) to find (see rpc_reading_service.discovery)",
    )  # fmt: skip
    parser.add_argument("--job", default="default", help="job name to register under with --store (default 'default')")
    parser.add_argument(
        "--advertise-host", metavar="HOST",
        help="host name or IP trainers should dial, registered with --store (default: the --host address, or "
        "with --host 0.0.0.0 this host's IP on the route to the store)",
    )  # fmt: skip
    parser.add_argument(
        "--store-timeout", type=float, default=300.0, help="seconds to wait for the --store to come up (default 300)"
    )
    parser.add_argument(
        "--metrics-port", type=int, metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port, logged); needs "
        "pip install 'rpc-reading-service[metrics]'",
    )  # fmt: skip
    parser.add_argument("--metrics-host", metavar="HOST", help="address of --metrics-port (default: the --host address)")
    parser.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--announce-fd", type=int, help=argparse.SUPPRESS)  # local servers: address on this pipe
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument("--version", action="version", version=f"rpc_reading_service {__version__}")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``rpc-reading-worker``; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.transport not in available_transports():
            raise ConfigurationError(
                f"unknown transport {args.transport!r}; available transports: {', '.join(available_transports())}"
            )
        registration = WorkerRegistration(args.store, args.job, args.store_timeout) if args.store else None
        server = WorkerServer(
            host=args.host,
            port=args.port,
            auth_key=load_auth_key(args.auth_key_file),
            transport=args.transport,
            session_mode=args.session_mode,
            parent_pid=args.parent_pid,
            handshake_timeout=args.handshake_timeout,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            max_frame_bytes=args.max_frame_bytes,
            max_sessions=args.max_sessions,
            idle_timeout=args.idle_timeout,
            stats_interval=args.stats_interval,
            cache=_cache_config(args),
            drain_timeout=args.drain_timeout,
        )
        if registration is not None:
            advertised = advertised_address(server.address, args.advertise_host, args.store)
        metrics = None
        if args.metrics_port is not None:
            from ..metrics.worker_server import serve_worker_metrics

            metrics = serve_worker_metrics(server, args.metrics_host or args.host, args.metrics_port)
    except ConfigurationError as exc:
        print(f"rpc-reading-worker: error: {exc}", file=sys.stderr)
        return 2
    # Import the heavy libraries before the first fork (or thread), so sessions start warm.
    with contextlib.suppress(ImportError), torchdata_banner_muted():
        import torchdata.dataloader2  # noqa: F401 - where it exists (torchdata < 0.10): user graphs may use it

    def announce(line: str) -> None:
        if args.announce_fd is None:
            print(line, flush=True)
        else:  # stdout is the trainer's: the address goes to the pipe it reads once
            os.write(args.announce_fd, line.encode("utf-8") + b"\n")
            os.close(args.announce_fd)
        if registration is not None:
            registration.start(advertised, on_failure=server.stop)

    try:
        serve_until_signalled(server, announce)
    finally:
        if metrics is not None:
            metrics.close()
    if registration is not None:
        registration.stop()
        if registration.error is not None:
            return 1
    return 0


def run() -> None:
    """Console-script entry point: :func:`main`, then a fast exit.

    Everything is closed and reaped by then; skipping interpreter teardown (torch's takes
    about half a second) lets trainers stop local workers quickly.
    """
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
