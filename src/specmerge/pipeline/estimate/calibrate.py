"""This machine's rates, measured by small timed probes: what the cost model (:mod:`.cost`) prices operations with.

:class:`ComputeRates` times each primitive on first use, with torch's current thread count (a merge's, inside
:func:`~specmerge.pipeline.run.threads.merge_threads`), and keeps it for the process: float32 matrix products
(flop/s), Householder QR (flop/s), symmetric eigendecompositions at a few sizes (a table of seconds, read
between its sizes along the measured curve and above the largest as d^3), SVDs (seconds per l k^2 of an l x k
matrix, from one square probe), elementwise passes and copies into new memory (bytes/s), the chunked linear
merge itself (bytes/s of its memory traffic), exact top-k selection and random draws (entries/s). Only the
primitives a plan uses are measured: about 0.3 s of probes for a task-arithmetic plan, 2 s for a spectral one.

:func:`input_reads` looks at the inputs' files without reading them: which share of each is in the page cache
(``mincore`` on a memory map, Linux), then times mapped reads of 16 MiB the way the reader reads
(``MADV_POPULATE_READ``) in three files where resident (the page-cache rate) and three where not (the disk rate;
those bytes are then cached), keeping the slowest: a virtual disk's rate depends on the host's cache.
Writing cannot be timed without writing: the output is flushed at :data:`DISK_RATE` (this project's 2-CPU box
syncs about 530 MB/s, ``dd ... conv=fdatasync``). What is not measured is said in ``sources``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

DISK_RATE = 500e6  # bytes/s read or written when not measured (SATA-SSD class; this project's CI box: ~500 MB/s)
CACHED_RATE = 10e9  # bytes/s mapping page-cache pages when no resident window could be timed
PROBE_BYTES = 16 * 2**20  # one timed read of the inputs
PROBE_FILES = 3  # input files timed per kind of read (page cache, disk)
EIGH_SIZES = (256, 512, 1024, 2048)  # the probes of the eigendecomposition, up to what a plan needs
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
RATE_NAMES = (
    "matmul",
    "qr",
    "svd",
    "memory",
    "fresh",
    "linear",
    "select",
    "random",
)  # the probed rates of ComputeRates


def _best(run: Callable[[], object], repeats: int, device: torch.device) -> float:
    """The shortest of ``repeats`` timed runs after one untimed warm-up (seconds)."""
    best = math.inf
    for i in range(repeats + 1):
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


class ComputeRates:
    """The compute rates of ``device`` with torch's current thread count, each probed on first use (see the module
    docstring); ``probe_seconds`` adds up the time spent probing, ``sources`` says how each rate was obtained."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.threads = torch.get_num_threads()
        self.probe_seconds = 0.0
        self.sources: dict[str, str] = {}
        self._eigh: dict[int, float] = {}
        self._probe_eigh = True

    @classmethod
    def given(cls, eigh: Mapping[int, float] | None = None, **rates: float) -> ComputeRates:
        """Rates given instead of probed (tests, what-if estimates): any of :data:`RATE_NAMES` as keywords, and
        ``eigh`` as size -> seconds (then no eigendecomposition is probed). A rate not given is probed if used."""
        given = cls("cpu")
        for key, value in rates.items():
            if key not in RATE_NAMES:
                raise ValueError(f"unknown rate {key!r}: give one of {', '.join(RATE_NAMES)}")
            given.__dict__[key] = float(value)  # the cached property's value
            given.sources[key] = "given"
        if eigh:
            given._eigh.update({int(d): float(s) for d, s in eigh.items()})
            given._probe_eigh = False
            given.sources["eigh"] = "given"
        return given

    def _timed(self, key: str, what: str, measure: Callable[[], float]) -> float:
        start = time.perf_counter()
        value = measure()
        self.probe_seconds += time.perf_counter() - start
        self.sources[key] = what
        return value

    def _filled(self, count: int, value: float) -> torch.Tensor:
        return torch.full((count,), value, device=self.device)

    def _randn(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = torch.Generator(device="cpu").manual_seed(0)
        return torch.randn(shape, generator=g).to(device=self.device, dtype=dtype)

    @functools.cached_property
    def matmul(self) -> float:
        """flop/s of a float32 matrix product."""
        a, b = self._randn(1024, 1024), self._randn(1024, 1024)
        return self._timed("matmul", "1024 x 1024 product", lambda: 2 * 1024**3 / _best(lambda: a @ b, 3, self.device))

    @functools.cached_property
    def qr(self) -> float:
        """flop/s of a Householder QR with Q formed (4 m n^2 - 4/3 n^3 flops)."""
        m, n = 2048, 512
        a = self._randn(m, n)
        flops = 4 * m * n * n - 4 / 3 * n**3
        return self._timed("qr", f"QR of {m} x {n}", lambda: flops / _best(lambda: torch.linalg.qr(a), 2, self.device))

    @functools.cached_property
    def svd(self) -> float:
        """Seconds per l k^2 of an SVD with vectors of an l x k matrix (k <= l), from a 1024 x 1024 probe."""
        a = self._randn(1024, 1024)
        run = lambda: torch.linalg.svd(a, full_matrices=False)  # noqa: E731
        return self._timed("svd", "SVD of 1024 x 1024", lambda: _best(run, 1, self.device) / 1024**3)

    @functools.cached_property
    def memory(self) -> float:
        """bytes/s of an elementwise float32 pass larger than the caches (two read, one written)."""
        a, b = self._filled(8 * 2**20, 1.0), self._filled(8 * 2**20, 1e-9)  # the speed of an add: not the values'
        size = 3 * a.numel() * 4
        return self._timed("memory", "float32 add of 32 MiB", lambda: size / _best(lambda: a.add_(b), 3, self.device))

    @functools.cached_property
    def linear(self) -> float:
        """bytes/s of the chunked linear merge (:func:`~specmerge.pipeline.run.compute.linear_merge`), counting its
        inputs and output once each: float16 base and two experts of 8 Mi entries."""
        from specmerge.pipeline.plan.rules import TensorPlan
        from specmerge.pipeline.run.compute import linear_merge

        n, count = 2, 8 * 2**20
        base = torch.full((count,), 0.5, dtype=torch.float16)
        experts = [torch.full((count,), 0.5 + 0.01 * (i + 1), dtype=torch.float16) for i in range(n)]
        entry = TensorPlan("probe", (count,), torch.float16, "merge", "task_arithmetic", {"scale": 0.3}, "probe")
        size = (n + 2) * count * 2
        run = lambda: linear_merge(entry, base, experts, (0.3,) * len(experts), torch.float32)  # noqa: E731
        cpu = torch.device("cpu")
        return self._timed(
            "linear", "chunked linear merge, 2 experts of 8 Mi float16", lambda: size / _best(run, 1, cpu)
        )

    @functools.cached_property
    def fresh(self) -> float:
        """bytes/s of copying into newly allocated memory (its pages faulted in on the way), as writing a tensor
        into the page cache costs the writer thread's CPU."""
        source = self._filled(8 * 2**20, 1.0)
        run = lambda: torch.empty_like(source).copy_(source)  # noqa: E731
        return self._timed("fresh", "copy of 32 MiB into new memory", lambda: 32 * 2**20 / _best(run, 2, self.device))

    @functools.cached_property
    def select(self) -> float:
        """Entries/s through an exact top-k selection (:func:`~specmerge.linalg.topk.top_k_rule`)."""
        from specmerge.linalg.topk import top_k_rule

        x = self._randn(4 * 2**20)
        run = lambda: top_k_rule(x, x.numel() // 5)  # noqa: E731
        return self._timed("select", "top-k of 4 Mi entries", lambda: x.numel() / _best(run, 2, self.device))

    @functools.cached_property
    def random(self) -> float:
        """Uniform float32 numbers/s from a seeded CPU generator (DARE's masks)."""
        g = torch.Generator(device="cpu").manual_seed(0)
        count = 4 * 2**20
        run = lambda: torch.rand(count, generator=g)  # noqa: E731
        return self._timed("random", "4 Mi uniform draws", lambda: count / _best(run, 2, torch.device("cpu")))

    @property
    def eigh_probes(self) -> dict[int, float]:
        """The eigendecompositions timed so far: size -> seconds."""
        return dict(sorted(self._eigh.items()))

    def eigh_seconds(self, d: int) -> float:
        """Seconds of a symmetric eigendecomposition of size ``d``, from probes up to min(2048, next size >= d)."""
        if d <= 0:
            return 0.0
        sizes = [s for s in EIGH_SIZES if s < d] + [s for s in EIGH_SIZES if s >= d][:1]
        for s in sizes if self._probe_eigh else ():
            if s not in self._eigh:
                x = self._randn(s, s)
                c = x @ x.T
                sizes_now = ", ".join(map(str, sorted({*self._eigh, s})))
                run = lambda c=c: torch.linalg.eigh(c)  # noqa: E731
                self._eigh[s] = self._timed("eigh", f"eigh of {sizes_now}", lambda run=run: _best(run, 1, self.device))
        known = sorted(self._eigh)
        below = [s for s in known if s <= d]
        above = [s for s in known if s >= d]
        if not below or not above:  # outside the probes: d^3 from the nearest one
            s = below[-1] if below else above[0]
            return self._eigh[s] * (d / s) ** 3
        lo, hi = below[-1], above[0]
        if lo == hi:
            return self._eigh[lo]
        slope = math.log(self._eigh[hi] / self._eigh[lo]) / math.log(hi / lo)
        return self._eigh[lo] * (d / lo) ** slope


@functools.cache
def compute_rates(device: str = "cpu", threads: int | None = None) -> ComputeRates:
    """The process's :class:`ComputeRates` for ``device`` and a thread count (default: torch's current one)."""
    return ComputeRates(device)


def rates_now(device: torch.device | str = "cpu") -> ComputeRates:
    """The shared rates for ``device`` with torch's thread count now (probed on first use, kept for the process)."""
    return compute_rates(str(torch.device(device)), torch.get_num_threads())


# ---------------------------------------------------------------------------------------------
# Reading the inputs


@dataclass(frozen=True)
class InputReads:
    """How fast the inputs can be read: the share of each input's bytes in the page cache (by input label), the
    page-cache and disk rates (bytes/s), the output's disk write rate, and how each was obtained."""

    resident: Mapping[str, float]
    cached_rate: float = CACHED_RATE
    disk_rate: float = DISK_RATE
    write_rate: float = DISK_RATE
    sources: dict[str, str] = field(default_factory=dict)
    probe_seconds: float = 0.0

    def seconds(self, label: str, nbytes: float) -> tuple[float, float]:
        """(page-cache seconds, disk seconds) to read ``nbytes`` of input ``label``."""
        share = self.resident.get(label, 0.0)
        return nbytes * share / self.cached_rate, nbytes * (1 - share) / self.disk_rate


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident_pages(path: Path) -> bytes | None:
    """One byte per page of the file, bit 0 set where the page is in the page cache (``mincore``); None where this
    cannot be asked (not Linux, an empty file, a file system without memory maps)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mincore"):
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vector = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
            if libc.mincore(address, size, vector) != 0:
                return None
            return vector.raw
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def _window(pages: bytes, resident: bool, length: int) -> int | None:
    """The first page of ``length`` consecutive pages all resident (or all not) from the file's middle on, else from
    its start; None if there is none (mincore sets the lowest bit of a page's byte; the other bits are 0)."""
    pattern = (b"\x01" if resident else b"\x00") * length
    first = pages.find(pattern, len(pages) // 2)  # from the middle: away from the header and what read-ahead took
    if first < 0:
        first = pages.find(pattern)
    return None if first < 0 else first


def _timed_read(path: Path, page: int, length: int) -> float:
    """Seconds to map ``length`` bytes of the file from page ``page`` and fault them in, as the reader does."""
    with open(path, "rb") as f:
        start = time.perf_counter()
        region = mmap.mmap(f.fileno(), length, access=mmap.ACCESS_COPY, offset=page * mmap.PAGESIZE)
        try:
            region.madvise(MADV_POPULATE_READ)
        except (OSError, ValueError, AttributeError):
            sum(region[i] for i in range(0, length, mmap.PAGESIZE))  # touch every page instead
        seconds = time.perf_counter() - start
        region.close()
    return max(seconds, 1e-9)


def input_reads(inputs: Mapping[str, Sequence[Path]], *, probe: bool = True) -> InputReads:
    """How fast each input (label -> its real files, e.g. ``source.files()``) can be read; see the module docstring.

    ``probe`` False: residency only, rates :data:`CACHED_RATE` and :data:`DISK_RATE` (nothing read).
    """
    start = time.perf_counter()
    pages: dict[Path, bytes | None] = {}
    resident: dict[str, float] = {}
    sources = {}
    unknown = []
    for label, files in inputs.items():
        total = cached = 0
        for path in files:
            if path not in pages:
                pages[path] = resident_pages(path)
            flags = pages[path]
            if flags is None:
                unknown.append(label)
                continue
            total += len(flags)
            cached += len(flags) - flags.count(0)
        resident[label] = cached / total if total else 0.0
    if unknown:
        sources["resident"] = f"unknown for {len(set(unknown))} input(s): taken as not cached (read from disk)"
    else:
        sources["resident"] = "mincore of every input file (nothing read)"
    rates = {"cached": CACHED_RATE, "disk": DISK_RATE}
    length = PROBE_BYTES // mmap.PAGESIZE
    for kind, is_resident in (("cached", True), ("disk", False)):
        sources[kind] = "not measured: assumed"
        if not probe:
            continue
        candidates = sorted(((len(f), p) for p, f in pages.items() if f is not None and len(f) >= length), reverse=True)
        timed = []
        for _, path in candidates:  # the largest files first; the slowest read counts (disks vary)
            first = _window(pages[path], is_resident, length)
            if first is not None:
                timed.append((PROBE_BYTES / _timed_read(path, first, PROBE_BYTES), path.name))
            if len(timed) == PROBE_FILES:
                break
        if timed:
            rates[kind], name = min(timed)
            where = "page cache" if is_resident else "disk"
            sources[kind] = f"16 MiB of {len(timed)} input file(s) timed ({where}), the slowest: {name}"
    sources["write"] = f"assumed {DISK_RATE / 1e6:.0f} MB/s (timing it would mean writing)"
    return InputReads(resident, rates["cached"], rates["disk"], DISK_RATE, sources, time.perf_counter() - start)


def process_rss() -> int:
    """This process's resident set now (bytes; VmRSS of /proc/self/status), 0 where it cannot be read."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def process_age() -> float | None:
    """Seconds since this process started (from /proc: its start time and the system's uptime), None where this
    cannot be read; at a command's start, what starting Python and importing torch and specmerge took."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, after the command name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - started)
