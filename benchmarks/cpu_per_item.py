#!/usr/bin/env python
"""CPU time and wake-ups per item, trainer and workers apart, for one contender at several
item sizes: numbers that a loaded machine moves far less than wall-clock rates.

::

    python benchmarks/cpu_per_item.py --contender RPCRS-local --workers 1 --sizes 16K,64K,256K,1M
    python benchmarks/cpu_per_item.py --contender raw-unix --sizes 64K --items 4000
    python benchmarks/cpu_per_item.py --contender RPCRS-tcp --sizes 256K --cprofile --py-spy /tmp/spy

This process is the trainer; every other process it starts (local workers, the raw sender,
the TCP worker server and its sessions) counts as "workers".  Over the timed items (after
``--warmup`` items) it reads, from ``/proc``, the CPU time (user + system, every thread) and
the voluntary context switches (a thread that blocked: a wake-up later) of both sides.
``--cprofile`` prints the trainer's functions by own time with their calls per item;
``--cprofile-loop`` profiles the trainer's receive loop thread instead, and ``--calls-loop`` counts
its Python and C calls per DATA frame (``sys.setprofile``: deterministic, the load does not move
it); ``--py-spy DIR`` records every process's Python stacks (``py-spy record``, collapsed stacks)
during the timed items.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.insert(0, os.path.dirname(BENCH_DIR))

from bench import item_sizes, setup_environment  # noqa: E402
from benchsuite.contenders import CONTENDERS  # noqa: E402
from benchsuite.measure import touch  # noqa: E402
from benchsuite.processes import ServerPool, launch_rpcrs_server, spawn, stop_processes  # noqa: E402
from benchsuite.report.format import fmt_size  # noqa: E402
from workloads import Workload  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every living descendant of ``pid``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rpartition(")")[2].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def usage(pid: int) -> tuple[float, int, int]:
    """CPU seconds (user + system, all threads), voluntary context switches (all threads) and
    minor page faults of ``pid``."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        cpu = (int(fields[11]) + int(fields[12])) / TICKS
        switches = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/status") as status:
                for line in status:
                    if line.startswith("voluntary_ctxt_switches"):
                        switches += int(line.split()[1])
        return cpu, switches, int(fields[7])
    except OSError:
        return 0.0, 0, 0


def thread_usage() -> dict[str, tuple[float, int, float]]:
    """:func:`usage` of each of this process's threads (and its :func:`run_delay`), by thread name."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    found: dict[str, tuple[float, int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()
            with open(f"/proc/self/task/{tid}/status") as status:
                switches = sum(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))
        except OSError:
            continue
        name = names.get(int(tid), f"thread-{tid}")
        found[name] = ((int(fields[11]) + int(fields[12])) / TICKS, switches, run_delay("self", tid))
    return found


def run_delay(pid: int | str, tid: int | str) -> float:
    """Seconds thread ``tid`` of ``pid`` was ready to run but waited for a CPU (``schedstat``)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def worker_threads() -> dict[str, tuple[float, int, float]]:
    """CPU seconds, voluntary context switches and run delay (:func:`run_delay`) of the descendants' threads, by their kernel
    name (``comm``: Python threads carry their names there only where something sets them, as
    ``--stalls``'s ``probe/sitecustomize.py`` does; else every thread counts as ``python``)."""
    found: dict[str, tuple[float, int]] = {}
    for pid in descendants(os.getpid()):
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                    name = comm.read().strip()
                with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                    fields = stat.read().rpartition(")")[2].split()
                with open(f"/proc/{pid}/task/{tid}/status") as status:
                    switches = sum(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))
                cpu, n, delay = found.get(name, (0.0, 0, 0.0))
                found[name] = (cpu + (int(fields[11]) + int(fields[12])) / TICKS, n + switches, delay + run_delay(pid, tid))
        except OSError:
            continue
    return found


def snapshot() -> dict[int, tuple[float, int, int]]:
    """:func:`usage` of this process and of each of its descendants, by pid."""
    me = os.getpid()
    return {pid: usage(pid) for pid in [me] + descendants(me)}


def spy(directory: str, label: str) -> list[subprocess.Popen]:
    """``py-spy record`` of this process and every descendant that runs Python, into ``directory``."""
    os.makedirs(directory, exist_ok=True)
    procs = []
    for pid in [os.getpid()] + descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"python" not in cmdline.read():
                    continue
        except OSError:
            continue
        role = "trainer" if pid == os.getpid() else f"worker-{pid}"
        out = os.path.join(directory, f"{label}-{role}.txt")
        procs.append(spawn(["py-spy", "record", "--nonblocking", "-r", "500", "-f", "raw", "-o", out,
                            "-p", str(pid)]))
    return procs


class LoopProfile:
    """A profiler (cProfile, or a ``sys.setprofile`` call counter) of the trainer's receive loop
    thread, switched on and off by that thread at its next hand-over of frames."""

    def __init__(self, count: bool):
        from rpc_reading_service.trainer.receive_loop import ReceiveLoop

        self.profile = None if count else cProfile.Profile(time.thread_time)
        self.calls: dict[str, int] = {}
        self.want = self.on = False
        original = getattr(ReceiveLoop, "unprofiled", ReceiveLoop._deliver_handed)

        def profile_switch(loop):
            if self.want != self.on:
                self.on = self.want
                if self.profile is not None:
                    self.profile.enable() if self.on else self.profile.disable()
                else:
                    sys.setprofile(self._count if self.on else None)
            return original(loop)

        ReceiveLoop.unprofiled, ReceiveLoop._deliver_handed = original, profile_switch

    def _count(self, frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_name != "profile_switch":  # not the loop's own
            self.calls[frame.f_code.co_name] = self.calls.get(frame.f_code.co_name, 0) + 1
        elif event == "c_call":
            self.calls["C:" + arg.__name__] = self.calls.get("C:" + arg.__name__, 0) + 1

    def switch(self, on: bool) -> None:
        """Ask the loop's thread to start (stop) at its next turn; wait until it did."""
        self.want = on
        deadline = time.monotonic() + 10
        while self.on != on and time.monotonic() < deadline:
            time.sleep(0.001)

    def report(self, items: int, rows: int) -> None:
        """Print the loop's functions with their calls per DATA frame (and per item)."""
        if self.profile is not None:
            stats = pstats.Stats(self.profile).stats
            frames = sum(ncalls for (_, _, name), (_, ncalls, *_) in stats.items() if name == "_on_data")
            print(f"-- cProfile of the receive loop: {frames / items:.3f} DATA frames per item; own time, calls per frame")
            rows_ = sorted(stats.items(), key=lambda kv: -kv[1][2])[:rows]
            for (path, line, name), (calls, ncalls, tottime, cumtime, _) in rows_:
                print(f"   {1e6 * tottime / max(frames, 1):8.1f} us/frame  {ncalls / max(frames, 1):7.2f} calls/frame  "
                      f"{os.path.basename(path)}:{line} {name}")
            return
        frames = max(self.calls.get("_on_data", 0), 1)
        python = sum(n for name, n in self.calls.items() if not name.startswith("C:"))
        print(f"-- calls of the receive loop: {frames / items:.3f} DATA frames per item; per frame "
              f"{python / frames:.1f} Python, {(sum(self.calls.values()) - python) / frames:.1f} C")
        for name, n in sorted(self.calls.items(), key=lambda kv: -kv[1])[:rows]:
            print(f"   {n / frames:7.2f}  {name}")


class Stalls:
    """``--stalls``: where the trainer's threads wait (the consumer for frames, the receive loop
    in ``select``), its DATA frames and hand-overs, and the workers' waits (``probe/``)."""

    def __init__(self, directory: str):
        from rpc_reading_service.policies.merge import EpochProgress
        from rpc_reading_service.trainer.channel import WorkerChannel
        from rpc_reading_service.trainer.receive_loop import ReceiveLoop

        self.directory = directory
        self.local: dict[str, list] = {}
        wait, on_data, loop_init = EpochProgress.wait, WorkerChannel._on_data, ReceiveLoop.__init__
        deliver = ReceiveLoop._deliver_handed

        def add(what: str, seconds: float) -> None:
            entry = self.local.setdefault(f"{threading.current_thread().name}|{what}", [0.0, 0])
            entry[0] += seconds
            entry[1] += 1

        def timed_wait(progress, source, stats=None):
            if not source.empty():
                return wait(progress, source, stats)
            start = time.perf_counter()
            try:
                return wait(progress, source, stats)
            finally:
                add("blocked for a frame", time.perf_counter() - start)

        def counted_on_data(channel, event):
            add("DATA frames", 0.0)
            return on_data(channel, event)

        def counted_deliver(loop):
            if loop._handed:
                add("hand-overs (turns that queue events)", 0.0)
            return deliver(loop)

        def probed_init(loop, *args, **kwargs):
            loop_init(loop, *args, **kwargs)
            select = loop._selector.select

            def timed_select(timeout=None):
                start = time.perf_counter()
                try:
                    return select(timeout)
                finally:
                    add("select", time.perf_counter() - start)

            loop._selector.select = timed_select

        EpochProgress.wait, WorkerChannel._on_data, ReceiveLoop.__init__ = timed_wait, counted_on_data, probed_init
        ReceiveLoop._deliver_handed = counted_deliver

    def totals(self) -> dict[str, list]:
        """Every process's totals so far, ``trainer|THREAD|what`` / ``worker|THREAD|what``."""
        import json

        found = {f"trainer|{key}": list(value) for key, value in self.local.items()}
        for entry in os.listdir(self.directory):
            if entry.endswith(".json"):
                try:
                    with open(os.path.join(self.directory, entry)) as data:
                        for key, value in json.load(data).items():
                            total = found.setdefault(f"worker|{key}", [0.0, 0])
                            total[0] += value[0]
                            total[1] += value[1]
                except (OSError, ValueError):
                    continue
        return found

    def difference(self, before: dict[str, list]) -> dict[str, list]:
        """What was added to the totals since ``before``."""
        time.sleep(0.05)  # the workers' next dump
        return {key: [value[0] - before.get(key, [0.0, 0])[0], value[1] - before.get(key, [0.0, 0])[1]]
                for key, value in self.totals().items()}

    @staticmethod
    def report(items: int, delta: dict[str, list]) -> None:
        """Each wait per item: microseconds and times."""
        print("   waits per item (us, times): " + "; ".join(
            f"{key} {1e6 * seconds / items:.1f} us {n / items:.3f}x"
            for key, (seconds, n) in sorted(delta.items()) if n))


STALLS: "Stalls | None" = None


def measure(contender, item_bytes: int, workers: int, items: int, warmup: int, args) -> dict:
    """One epoch: ``warmup`` items, then ``items`` timed ones with both sides' CPU and switches."""
    # As many untimed items after the timed ones: a worker's producer thread is still alive at
    # the last reading (the switches of a thread that ended are no longer in /proc).
    workload = Workload(args.kind, warmup + 2 * items, item_bytes=item_bytes)
    profile = cProfile.Profile(time.thread_time) if args.cprofile else None  # CPU, not wall: load moves no time
    spies: list[subprocess.Popen] = []
    loop_profile = LoopProfile(bool(args.calls_loop)) if args.cprofile_loop or args.calls_loop else None
    stalls = STALLS
    with contender.epoch(workload, workers) as loader:
        iterator = iter(loader)
        for _ in range(warmup):
            touch(next(iterator))
        if args.py_spy:
            spies = spy(args.py_spy, f"{contender.name}-{fmt_size(item_bytes).replace(' ', '')}")
            time.sleep(0.5)  # py-spy attaches
        workers_before = worker_threads()
        stall_before = stalls.totals() if stalls else None
        threads_before, before, t0 = thread_usage(), snapshot(), time.perf_counter()
        if profile:
            profile.enable()
        if loop_profile:
            loop_profile.switch(True)
        for _ in range(items):
            touch(next(iterator))
        if profile:
            profile.disable()
        if loop_profile:
            loop_profile.switch(False)
        wall, after, threads_after = time.perf_counter() - t0, snapshot(), thread_usage()
        if stalls:
            stall_before = stalls.difference(stall_before)
        workers_after = worker_threads()
        for proc in spies:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file and exits
        for proc in spies:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=20)
        stop_processes(spies)
    me = os.getpid()
    delta = {pid: [now - then for now, then in zip(after[pid], before.get(pid, (0.0, 0, 0)))] for pid in after}
    workers_cpu, workers_switches, workers_faults = (sum(d[k] for pid, d in delta.items() if pid != me) for k in range(3))
    none = (0.0, 0, 0.0)
    threads = {name: (1e6 * (cpu - threads_before.get(name, none)[0]) / items,
                      (n - threads_before.get(name, none)[1]) / items,
                      1e6 * (delay - threads_before.get(name, none)[2]) / items)
               for name, (cpu, n, delay) in threads_after.items()}
    busy = sorted(((cpu, n, delay, name) for name, (cpu, n, delay) in threads.items() if cpu or n), reverse=True)
    print(f"   trainer threads ({fmt_size(item_bytes)}): " + ", ".join(
        f"{name} {cpu:.1f} us {n:.2f} sw {delay:.1f} us ready" for cpu, n, delay, name in busy[:4]) + " per item")
    switched = sorted(((n - workers_before.get(name, none)[1]) / items,
                       1e6 * (cpu - workers_before.get(name, none)[0]) / items,
                       1e6 * (delay - workers_before.get(name, none)[2]) / items, name)
                      for name, (cpu, n, delay) in workers_after.items())
    print(f"   workers' threads ({fmt_size(item_bytes)}): " + ", ".join(
        f"{name} {cpu:.1f} us {n:.2f} sw {delay:.1f} us ready" for n, cpu, delay, name in reversed(switched)
        if n > 0.005 or cpu) + " per item (us ready: waiting for a CPU)")
    if stalls:
        stalls.report(items, stall_before)
    if profile:
        print(f"-- cProfile of the trainer, {fmt_size(item_bytes)}: own time, calls per item")
        stats = pstats.Stats(profile)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[: args.cprofile]
        for (path, line, name), (calls, ncalls, tottime, cumtime, _) in rows:
            print(f"   {1e6 * tottime / items:8.1f} us/item  {ncalls / items:7.2f} calls/item  "
                  f"{os.path.basename(path)}:{line} {name}")
    if loop_profile:
        loop_profile.report(items, args.cprofile_loop or args.calls_loop)
    return {"size": item_bytes, "items_per_s": items / wall, "gb_per_s": items * item_bytes / wall / 1e9,
            "trainer_us": 1e6 * delta[me][0] / items, "workers_us": 1e6 * workers_cpu / items,
            "trainer_switches": delta[me][1] / items, "workers_switches": workers_switches / items,
            "trainer_faults": delta[me][2] / items, "workers_faults": workers_faults / items}


def main(argv=None) -> int:
    """Parse the arguments, measure each size, print one row per size."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contender", choices=["RPCRS-local", "RPCRS-tcp", "raw-socket", "raw-unix", "pipeline-limit",
                                                    "pipeline-limit-unix"],
                        default="RPCRS-local")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--kind", choices=["tensor", "labelled-tensor"], default="tensor",
                        help="each item a bare tensor, or a tuple of a tensor and an int label")
    parser.add_argument("--sizes", type=item_sizes, default=item_sizes("16K,64K,256K,1M"))
    parser.add_argument("--bytes", type=item_sizes, default=[256 << 20], metavar="SIZE",
                        help="timed bytes per size (default 256M), between 500 and 20,000 items")
    parser.add_argument("--items", type=int, help="timed items per size instead of --bytes")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--cprofile", type=int, nargs="?", const=25, default=0, metavar="ROWS")
    parser.add_argument("--cprofile-loop", type=int, nargs="?", const=25, default=0, metavar="ROWS",
                        help="cProfile the receive loop thread")
    parser.add_argument("--calls-loop", type=int, nargs="?", const=25, default=0, metavar="ROWS",
                        help="count the receive loop's calls per DATA frame")
    parser.add_argument("--py-spy", metavar="DIR")
    parser.add_argument("--stalls", action="store_true",
                        help="time where each thread waits, per item (the workers' through probe/sitecustomize.py)")
    args = parser.parse_args(argv)
    if args.py_spy and not shutil.which("py-spy"):
        parser.error("--py-spy: py-spy is not on PATH")
    setup_environment()
    if args.stalls:
        import tempfile

        global STALLS
        os.environ["RRS_PROBE_DIR"] = tempfile.mkdtemp(prefix="rrs-probe-")
        os.environ["PYTHONPATH"] = os.pathsep.join([os.path.join(BENCH_DIR, "probe"), os.environ["PYTHONPATH"]])
        STALLS = Stalls(os.environ["RRS_PROBE_DIR"])
    import torch

    torch.set_num_threads(1)  # as the bench's trainer
    servers = {}
    pool = None
    if args.contender == "RPCRS-tcp":
        auth_key = secrets.token_hex(16)
        pool = ServerPool("rpcrs", launch_rpcrs_server(auth_key))
        servers = {"addresses": pool.ensure(1), "auth_key": auth_key}
    contender = CONTENDERS[args.contender](servers)
    print(f"{args.contender} W={args.workers}, load average {os.getloadavg()[0]:.2f} "
          "(wall-clock rates move with it; CPU per item and switches per item much less)")
    print(f"{'size':>8} {'items/s':>9} {'GB/s':>6} {'trainer us/item':>16} {'workers us/item':>16} "
          f"{'trainer sw/item':>16} {'workers sw/item':>16} {'faults/item: trainer':>21} {'workers':>8}")
    try:
        for size in args.sizes:
            items = args.items or max(500, min(20_000, args.bytes[0] // size))
            row = measure(contender, size, args.workers, items, args.warmup, args)
            print(f"{fmt_size(size):>8} {row['items_per_s']:9,.0f} {row['gb_per_s']:6.2f} {row['trainer_us']:16.1f} "
                  f"{row['workers_us']:16.1f} {row['trainer_switches']:16.2f} {row['workers_switches']:16.2f} "
                  f"{row['trainer_faults']:21.1f} {row['workers_faults']:8.1f}",
                  flush=True)
    finally:
        if pool is not None:
            pool.close()
        if STALLS is not None:
            shutil.rmtree(STALLS.directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
