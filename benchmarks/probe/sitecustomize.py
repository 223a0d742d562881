"""``cpu_per_item.py --stalls``: put on PYTHONPATH (this directory) for the benchmark's worker
server and its sessions.  Names every thread in the kernel (``comm``, so that ``/proc`` says whose
CPU and switches they are) and times, per thread, where a worker's threads block: the outbox's two
conditions (the producer waiting for credit or a send, the sender waiting for work) and socket
sends.  Each process writes its totals to ``$RRS_PROBE_DIR/PID.json`` every 20 ms."""

import ctypes
import json
import os
import threading
import time

_DIR = os.environ.get("RRS_PROBE_DIR")
_TOTALS: dict = {}


def _name_thread(name: str) -> None:
    try:
        ctypes.CDLL(None).prctl(15, name[:15].encode(), 0, 0, 0)  # PR_SET_NAME
    except Exception:  # noqa: BLE001 - a measurement aid only
        pass


def _add(what: str, seconds: float) -> None:
    key = f"{threading.current_thread().name}|{what}"
    entry = _TOTALS.setdefault(key, [0.0, 0])
    entry[0] += seconds
    entry[1] += 1


def _timed(what: str, fn):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _add(what, time.perf_counter() - start)

    return timed


def _dump_forever() -> None:
    path = os.path.join(_DIR, f"{os.getpid()}.json")
    while True:
        time.sleep(0.02)
        try:
            with open(path + ".tmp", "w") as out:
                json.dump(dict(_TOTALS), out)
            os.replace(path + ".tmp", path)
        except (OSError, RuntimeError):
            pass


def _patch() -> None:
    """Wrap what a worker session blocks in (the package is imported by the time a session forks)."""
    try:
        from rpc_reading_service.worker import outbox
        from rpc_reading_service.transports.socket_transport import connection
    except ImportError:
        return
    if getattr(outbox.Outbox, "_probed", False):
        return
    init = outbox.Outbox.__init__

    def probed_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._cond.wait = _timed("wait sender cond", self._cond.wait)
        wait = self._producer_cond.wait

        def producer_wait(*args, **kwargs):
            reason = "no credit" if self._protocol.credits <= 0 else "credit left"
            return _timed(f"producer waits ({reason})", wait)(*args, **kwargs)

        self._producer_cond.wait = producer_wait

    outbox.Outbox.__init__ = probed_init
    outbox.Outbox._probed = True
    connection.SocketConnection.send = _timed("socket send", connection.SocketConnection.send)


def _in_child() -> None:
    _TOTALS.clear()
    _patch()
    threading.Thread(target=_dump_forever, name="probe-dump", daemon=True).start()


if _DIR:
    _bootstrap = threading.Thread._bootstrap_inner

    def _named_bootstrap(self):
        _name_thread(self.name.replace("rrs-", ""))
        return _bootstrap(self)

    threading.Thread._bootstrap_inner = _named_bootstrap
    os.register_at_fork(after_in_child=_in_child)
