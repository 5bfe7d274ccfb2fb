"""How many threads torch computes with during a merge or an inspect, so that a shared CPU does not collapse.

torch's CPU kernels run on an OpenMP team whose idle members spin for a while before they sleep. When the
team has a member on every CPU and something else also wants a CPU (another process, or specmerge's own
reader, writer and fsync threads), a member is descheduled, the others spin at the next barrier until it
runs again, and every one of the thousands of short parallel steps of a merge waits a scheduler slice: on
2 cores with one other CPU-bound process, a 136M task-arithmetic merge took 32-52 s with torch's default
threads instead of 4-5 s with one (BENCHMARKS.md, issue 13). The spin-wait policy of OpenMP cannot be
changed once torch is loaded, so specmerge picks the team's size instead.

The count, in order of precedence:

1. ``threads=N`` (``--threads N``): exactly N.
2. ``OMP_NUM_THREADS`` (or ``MKL_NUM_THREADS``) set in the environment, or ``torch.set_num_threads`` called
   after specmerge was imported: torch's current count, untouched.
3. Otherwise the default: the CPUs this process may use (its affinity mask, and the cgroup's CPU quota,
   ``cpu.max`` or ``cpu.cfs_quota_us``, rounded down), less the CPUs other processes keep busy when the
   work starts (sampled from ``/proc/stat`` for 50 ms wherever more than one CPU is usable), less one CPU
   for specmerge's reader, writer and fsync threads when that still leaves two or more; at least 1, at
   most torch's own default (physical cores). On an idle 2-CPU machine that is 2 threads (a compute-bound
   SWUDI-A merge takes half the time of 1 thread, linear merges the same), and 1 when another process
   keeps a CPU busy (BENCHMARKS.md, issue 13).

:func:`merge_threads` applies the count for the duration of one merge and restores torch's previous count
afterwards, also on error (torch's setting is per process: a library call must not leave it changed). The
reader and writer threads compute with one thread each while it is active (:func:`io_thread_setup`).
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from specmerge.errors import RecipeError

IO_CPUS = 1  # CPUs left to the reader, writer and fsync threads (and everything else on the machine)
BUSY_WINDOW = 0.05  # seconds over which other processes' CPU use is sampled
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # what torch itself reads for its default

TORCH_THREADS_AT_IMPORT = torch.get_num_threads()  # torch's own default, unless changed before this import
_active = 0  # merges in progress that set the thread count (the reader and writer threads follow it then)
_active_lock = threading.Lock()


@dataclass(frozen=True)
class CpuState:
    """What the default thread count is computed from; :func:`read_cpu_state` reads it from this machine.

    ``affinity``: CPUs in this process's affinity mask. ``quota``: the cgroup's CPU limit in CPUs (quota /
    period; None when unlimited). ``busy``: CPUs of those kept busy by other processes when sampled (None:
    not sampled). ``torch_default``: torch's own default thread count.
    """

    affinity: int
    quota: float | None = None
    busy: float | None = None
    torch_default: int | None = None

    @property
    def usable(self) -> int:
        """CPUs this process may keep busy: the affinity mask, capped by the quota rounded down; at least 1."""
        cpus = max(1, self.affinity)
        if self.quota is not None:
            cpus = min(cpus, max(1, math.floor(self.quota + 1e-9)))
        return cpus

    @property
    def needs_busy(self) -> bool:
        """Whether other processes' CPU use can change :func:`default_threads` (not on 1 usable CPU)."""
        return self.usable > 1


def default_threads(state: CpuState) -> int:
    """Usable CPUs, less those busy with other work (rounded), less IO_CPUS when at least two remain; at least 1,
    at most torch's default.

    The reader and writer threads mostly wait on the disk and page faults: on 2 free CPUs a second compute
    thread gains more (2x on a SWUDI-A merge) than the CPU left to them would; from 3 free CPUs one is left.
    """
    free = max(1, state.usable - (math.floor(state.busy + 0.5) if state.busy else 0))
    threads = free - IO_CPUS if free - IO_CPUS >= 2 else free
    if state.torch_default is not None:
        threads = min(threads, max(1, state.torch_default))
    return threads


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count a merge computes with, and where it comes from (recorded in the report)."""

    threads: int
    source: str

    def describe(self) -> str:
        return f"{self.threads} ({self.source})"


def max_threads() -> int:
    """The largest thread count accepted: more would only fail to start (1024, or 4 per CPU where more)."""
    return max(1024, 4 * (os.cpu_count() or 1))


def check_threads(value: object, what: str = "threads") -> int | None:
    """``threads`` as given to the API: None (the default) or a whole number from 1 to :func:`max_threads`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecipeError(f"{what} must be a whole number of at least 1 (or None for the default), got {value!r}")
    if value < 1:
        raise RecipeError(f"{what} must be at least 1, got {value}")
    if value > max_threads():
        raise RecipeError(f"{what} must be at most {max_threads()} on this machine, got {value}")
    return value


def parse_threads(text: str | None) -> int | None:
    """``--threads N`` as typed: a whole number from 1 to :func:`max_threads` (None when not given)."""
    if text is None:
        return None
    if not re.fullmatch(r"\s*[+-]?\d{1,30}\s*", text):
        raise RecipeError(f"--threads expects a whole number of at least 1, got {text!r}")
    return check_threads(int(text), "--threads")


def environment_threads(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """(variable, count) for the first of OMP_NUM_THREADS / MKL_NUM_THREADS set to a positive count, else None.

    As OpenMP reads it: ``4`` or a nested list ``4,2`` (the first level counts); other values are ignored.
    """
    environ = os.environ if environ is None else environ
    for name in THREAD_VARIABLES:
        match = re.fullmatch(r"\s*(\d+)\s*(,.*)?", environ.get(name, ""))
        if match and int(match.group(1)) > 0:
            return name, int(match.group(1))
    return None


def choose_threads(
    requested: int | None = None,
    *,
    state: CpuState | Callable[[], CpuState] | None = None,
    environ: Mapping[str, str] | None = None,
    current: int | None = None,
) -> ThreadChoice:
    """The thread count for a merge (see the module's docstring for the order of precedence).

    ``state`` (or a function returning it; default :func:`read_cpu_state`), ``environ`` (default
    ``os.environ``) and ``current`` (torch's count now) can be given instead of read from this process.
    """
    requested = check_threads(requested)
    if requested is not None:
        return ThreadChoice(requested, "threads option")
    current = torch.get_num_threads() if current is None else current
    variable = environment_threads(environ)
    if current != TORCH_THREADS_AT_IMPORT and (variable is None or current != variable[1]):
        return ThreadChoice(current, "torch.set_num_threads")
    if variable is not None:
        return ThreadChoice(current, f"{variable[0]}={variable[1]}")
    if state is None:
        state = read_cpu_state()
    elif callable(state):
        state = state()
    threads = default_threads(state)
    quota = "no CPU quota" if state.quota is None else f"CPU quota {state.quota:g}"
    busy = "" if state.busy is None else f", {state.busy:.1f} busy with other processes"
    return ThreadChoice(
        threads, f"default: {state.usable} usable CPUs (affinity {state.affinity}, {quota}){busy}, "
        f"{IO_CPUS} left for reading and writing"
    )  # fmt: skip


@contextmanager
def merge_threads(
    requested: int | None = None,
    *,
    state: CpuState | Callable[[], CpuState] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Iterator[ThreadChoice]:
    """Compute with :func:`choose_threads`'s count inside the block; torch's previous count is restored after.

    The count is torch's, for the whole process (``torch.set_num_threads``): a merge running next to other
    torch work in the same process sets it for that work too, while it runs.
    """
    global _active
    choice = choose_threads(requested, state=state, environ=environ)
    previous = torch.get_num_threads()
    with _active_lock:
        _active += 1
    try:
        if choice.threads != previous:
            torch.set_num_threads(choice.threads)
        yield choice
    finally:
        with _active_lock:
            _active -= 1
        # Always: a reader or writer thread that set its own count (io_thread_setup) also set torch's
        # default for threads started later; this puts that back too.
        torch.set_num_threads(previous)


def io_thread_setup() -> None:
    """ThreadPoolExecutor initializer of the reader and writer threads: inside :func:`merge_threads`, their
    own torch work (a checkpoint's tensor copied, a LoRA delta converted) uses one thread, not a second team
    the size of the machine's; outside it (the executor called directly) nothing changes."""
    if _active:
        torch.set_num_threads(1)  # this thread's team; merge_threads restores the default for new threads


# ---------------------------------------------------------------------------------------------
# Reading this machine


def read_cpu_state(
    *,
    proc: Path = Path("/proc"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    window: float = BUSY_WINDOW,
    sample_busy: bool = True,
    affinity: Collection[int] | None = None,
) -> CpuState:
    """This process's CPUs, cgroup quota and torch default; the CPUs others keep busy when that matters.

    ``proc``, ``cgroup_root`` and ``affinity`` (the CPU numbers; default ``os.sched_getaffinity``) can be
    given instead of this machine's, for tests."""
    cpus = _affinity() if affinity is None else affinity
    try:
        cgroup_text = (proc / "self" / "cgroup").read_text()
    except OSError:
        cgroup_text = ""
    state = CpuState(len(cpus), cgroup_quota(cgroup_text, cgroup_root), None, TORCH_THREADS_AT_IMPORT)
    if sample_busy and state.needs_busy:
        state = CpuState(state.affinity, state.quota, busy_cpus(cpus, proc / "stat", window), state.torch_default)
    return state


def _affinity() -> Collection[int]:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux
        return range(os.cpu_count() or 1)


def cgroup_quota(self_cgroup: str, root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The tightest CPU limit (in CPUs) on this process's cgroup and its ancestors, v2 or v1; None: none.

    ``self_cgroup`` is the text of /proc/self/cgroup. Inside a container the path shown may not exist
    under ``root`` (the container sees its own cgroup as the root): the limits found at ``root`` count.
    """
    limits: list[float] = []
    for line in self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2: "0::/path"
            limits += _walk(root, path, _v2_limit)
        elif "cpu" in controllers.split(","):
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                if mount.is_dir():
                    limits += _walk(mount, path, _v1_limit)
                    break
    if not self_cgroup.strip():
        limits += _walk(root, "/", _v2_limit)
    return min(limits, default=None)


def _walk(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """Limits in ``mount / path`` and every ancestor up to ``mount`` (``mount`` alone when the path is absent)."""
    folder = mount / path.strip("/")
    if not folder.is_dir():
        folder = mount
    found = []
    while True:
        limit = read(folder)
        if limit is not None:
            found.append(limit)
        if folder == mount or mount not in folder.parents:
            return found
        folder = folder.parent


def _v2_limit(folder: Path) -> float | None:
    try:
        quota, _, period = (folder / "cpu.max").read_text().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_limit(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def stat_ticks(text: str, cpus: Collection[int]) -> tuple[int, int, int]:
    """(busy, total, CPUs found) in a /proc/stat text, clock ticks summed over the given CPUs (busy: all but
    idle and iowait; steal counts as busy: another guest had the CPU)."""
    busy = total = found = 0
    wanted = set(cpus)
    for line in text.splitlines():
        name, *fields = line.split() or [""]
        if not re.fullmatch(r"cpu\d+", name) or int(name[3:]) not in wanted:
            continue
        user, nice, system, idle, iowait, irq, softirq, steal = ([int(f) for f in fields] + [0] * 8)[:8]
        busy += user + nice + system + irq + softirq + steal
        total += user + nice + system + idle + iowait + irq + softirq + steal
        found += 1
    return busy, total, found


def busy_cpus(
    cpus: Collection[int],
    stat: Path = Path("/proc/stat"),
    window: float = BUSY_WINDOW,
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.perf_counter,
    own_seconds: Callable[[], float] | None = None,
) -> float:
    """CPUs among ``cpus`` that other processes kept busy over ``window`` seconds (this process's own CPU time,
    its idle OpenMP threads spinning included, is subtracted); 0.0 when /proc/stat cannot be read.

    ``sleep``, ``clock`` and ``own_seconds`` (this process's CPU seconds) can be replaced, for tests."""
    own_seconds = _own_seconds if own_seconds is None else own_seconds
    try:
        own0, wall0, text0 = own_seconds(), clock(), stat.read_text()
        sleep(window)
        own1, wall1, text1 = own_seconds(), clock(), stat.read_text()
    except OSError:
        return 0.0
    (busy0, total0, _), (busy1, total1, found) = stat_ticks(text0, cpus), stat_ticks(text1, cpus)
    if total1 <= total0 or not found:
        return 0.0
    all_busy = (busy1 - busy0) / (total1 - total0) * found
    own = (own1 - own0) / max(wall1 - wall0, 1e-6)
    return max(0.0, min(float(found), all_busy - own))


def _own_seconds() -> float:
    times = os.times()
    return times.user + times.system
