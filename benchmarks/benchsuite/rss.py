"""Memory sampling of the measuring process: current and peak resident set size."""

from __future__ import annotations

import threading
from typing import Optional


def rss_kib(field: str = "VmRSS") -> Optional[int]:
    """A ``/proc/self/status`` memory field in KiB (VmRSS, VmHWM), or None."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakRss:
    """Peak resident memory of this process while the ``with`` block runs.

    Resets the kernel's peak (VmHWM) on entry where allowed, and samples VmRSS from a
    background thread every ``interval_s``; the peak is the larger of both.
    """

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, rss_kib() or 0)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "PeakRss":
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # reset VmHWM to the current RSS
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.hwm_reset:
            self.peak_kib = max(self.peak_kib, rss_kib("VmHWM") or 0)
