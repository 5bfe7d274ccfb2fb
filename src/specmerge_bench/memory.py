"""Peak memory of a process from Linux ``/proc/<pid>/status``: the one sampler every benchmark uses.

Fields (bytes): ``VmRSS`` (resident set: anonymous + file-backed pages, e.g. mapped checkpoint bytes),
``RssAnon`` (anonymous: tensors, heap), ``RssFile`` (file-backed) and ``VmHWM`` (the kernel's high-water
mark of VmRSS). A :class:`Sampler` polls them on a thread and keeps the maxima; with ``reset_peak`` it
first resets this process's VmHWM (``/proc/self/clear_refs``), so that VmHWM - baseline VmRSS is the exact
peak of the block, with no polling needed.
"""

from __future__ import annotations

import threading
from pathlib import Path

FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
GIB = 2**30


def read_status(pid: int | str = "self") -> dict[str, int]:
    """Bytes of each of ``FIELDS`` for a process (``"self"`` or a pid); {} if it has exited or is unreadable."""
    values = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in FIELDS:
                    values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return values


def reset_peak() -> None:
    """Reset this process's VmHWM to its current resident set (Linux ``clear_refs`` code 5)."""
    Path("/proc/self/clear_refs").write_text("5")


class Sampler:
    """The maxima of a process's memory fields while a ``with`` block runs, and its baseline at the start.

    ``pid``: ``"self"`` or another process (e.g. a child started with ``subprocess.Popen``); ``period``:
    seconds between polls on a background thread, or None to read only at the start and the end (enough
    for VmHWM); ``reset_peak``: reset this process's VmHWM first (only for ``pid="self"``).
    """

    def __init__(self, pid: int | str = "self", period: float | None = 0.005, reset_peak: bool = False) -> None:
        self.pid, self.period, self.reset = pid, period, reset_peak
        self.baseline: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        for key, value in read_status(self.pid).items():
            self.peak[key] = max(self.peak.get(key, 0), value)

    def _poll(self) -> None:
        assert self.period is not None
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period)

    def __enter__(self) -> Sampler:
        if self.reset:
            reset_peak()
        self.baseline = read_status(self.pid)
        self.peak = dict(self.baseline)
        if self.period is not None:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()

    def above_baseline(self, field: str, baseline_field: str | None = None) -> int:
        """Peak of ``field`` minus the baseline of ``baseline_field`` (default the same field), in bytes."""
        return self.peak.get(field, 0) - self.baseline.get(baseline_field or field, 0)

    def result(self) -> dict[str, float]:
        """The figures the whole-model memory benchmarks print, in GiB."""
        return {
            "peak_anon_above_baseline_gib": self.above_baseline("RssAnon") / GIB,
            "peak_rss_above_baseline_gib": self.above_baseline("VmRSS") / GIB,
            "peak_file_backed_gib": self.peak.get("RssFile", 0) / GIB,
            "vm_hwm_gib": self.peak.get("VmHWM", 0) / GIB,
            "baseline_rss_gib": self.baseline.get("VmRSS", 0) / GIB,
        }
