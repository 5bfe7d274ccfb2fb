"""torch's thread count during merges and inspects: the default from the CPUs free, --threads, restoring (issue 13)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import specmerge.diagnostics.run
from specmerge.cli import main
from specmerge.diagnostics.run import inspect_model
from specmerge.errors import RecipeError
from specmerge.pipeline.run import threads
from specmerge.pipeline.run.api import merge
from specmerge.pipeline.run.executor import StreamingExecutor
from specmerge.pipeline.run.threads import (
    CpuState,
    busy_cpus,
    cgroup_quota,
    choose_threads,
    default_threads,
    merge_threads,
)
from tiny_models import build_family

NO_THREAD_VARIABLES = {"PATH": "/usr/bin"}


@pytest.fixture(autouse=True)
def _torch_threads(monkeypatch):
    """Each test starts from torch's current count as the 'untouched' one, and leaves it as it found it."""
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "TORCH_THREADS_AT_IMPORT", before)
    for name in threads.THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("models"), "llama", n_experts=2)


# ---------------------------------------------------------------------------------------------
# The default, from injected inputs


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (CpuState(affinity=1), 1),
        (CpuState(affinity=2), 2),  # idle: a second compute thread beats a CPU left to reading and writing
        (CpuState(affinity=2, busy=0.0), 2),
        (CpuState(affinity=2, busy=1.0), 1),  # another CPU-bound process: one thread, no collapse
        (CpuState(affinity=2, busy=2.0), 1),
        (CpuState(affinity=3), 2),  # one CPU left to the reader and writer threads
        (CpuState(affinity=4, busy=1.0), 2),
        (CpuState(affinity=16, busy=0.0), 15),
        (CpuState(affinity=16, busy=0.3), 15),  # a little background work: rounded away
        (CpuState(affinity=16, busy=1.0), 14),  # another CPU-bound process
        (CpuState(affinity=16, busy=2.6), 12),
        (CpuState(affinity=16, busy=16.0), 1),  # never below one
        (CpuState(affinity=64, quota=4.0), 3),  # the cgroup quota, not the host's CPUs
        (CpuState(affinity=64, quota=2.5), 2),  # rounded down: 3 threads would be throttled
        (CpuState(affinity=64, quota=0.5), 1),
        (CpuState(affinity=8, quota=32.0), 7),  # a quota above the affinity mask changes nothing
        (CpuState(affinity=32, torch_default=16), 16),  # never more than torch's own (physical cores)
    ],
)
def test_default_threads(state, expected):
    assert default_threads(state) == expected


def test_busy_cpus_are_sampled_only_where_they_can_change_the_answer():
    assert not CpuState(affinity=1).needs_busy
    assert not CpuState(affinity=64, quota=1.5).needs_busy
    assert CpuState(affinity=2).needs_busy
    assert CpuState(affinity=64, quota=2.0).needs_busy


STAT = """cpu  900 0 300 5000 40 0 10 0 0 0
cpu0 {a} 0 100 {ia} 10 0 5 0 0 0
cpu1 {b} 0 100 {ib} 10 0 5 0 0 0
cpu2 100 0 100 1000 10 0 0 {steal} 0 0
intr 123 0 0
ctxt 456
"""


def test_busy_cpus_from_proc_stat_minus_own_time(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(STAT.format(a=100, b=100, ia=1000, ib=1000, steal=0))
    after = STAT.format(a=110, b=100, ia=1000, ib=1010, steal=0)  # cpu0 busy for 10 ticks, cpu1 idle
    now, own = iter([0.0, 0.1]), iter([5.0, 5.0])
    sampled = busy_cpus([0, 1], stat, 0.1, sleep=lambda _: stat.write_text(after), clock=lambda: next(now),
                        own_seconds=lambda: next(own))  # fmt: skip
    assert sampled == pytest.approx(1.0)
    # the same ticks, but this process used 0.05 s of CPU in the 0.1 s: half a CPU was its own
    stat.write_text(STAT.format(a=100, b=100, ia=1000, ib=1000, steal=0))
    now, own = iter([0.0, 0.1]), iter([5.0, 5.05])
    sampled = busy_cpus([0, 1], stat, 0.1, sleep=lambda _: stat.write_text(after), clock=lambda: next(now),
                        own_seconds=lambda: next(own))  # fmt: skip
    assert sampled == pytest.approx(0.5)
    # CPUs outside the affinity mask do not count; steal time does (another guest had the CPU)
    stat.write_text(STAT.format(a=100, b=100, ia=1000, ib=1000, steal=0))
    after = STAT.format(a=110, b=100, ia=1000, ib=1010, steal=10)
    now, own = iter([0.0, 0.1]), iter([0.0, 0.0])
    sampled = busy_cpus([2], stat, 0.1, sleep=lambda _: stat.write_text(after), clock=lambda: next(now),
                        own_seconds=lambda: next(own))  # fmt: skip
    assert sampled == pytest.approx(1.0)
    assert busy_cpus([0], tmp_path / "missing", 0.0) == 0.0


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_the_tightest_on_the_path(tmp_path):
    _write(tmp_path / "a" / "cpu.max", "150000 100000\n")
    _write(tmp_path / "a" / "b" / "cpu.max", "max 100000\n")
    assert cgroup_quota("0::/a/b\n", tmp_path) == pytest.approx(1.5)
    _write(tmp_path / "a" / "b" / "cpu.max", "50000 100000\n")
    assert cgroup_quota("0::/a/b\n", tmp_path) == pytest.approx(0.5)
    assert cgroup_quota("0::/elsewhere\n", tmp_path) is None  # the root has no cpu.max: no limit
    _write(tmp_path / "cpu.max", "400000 100000\n")  # a container sees its own cgroup at the root
    assert cgroup_quota("0::/not/visible/here\n", tmp_path) == pytest.approx(4.0)


def test_cgroup_v1_quota(tmp_path):
    folder = tmp_path / "cpu,cpuacct" / "docker" / "x"
    _write(folder / "cpu.cfs_quota_us", "300000\n")
    _write(folder / "cpu.cfs_period_us", "100000\n")
    text = "12:memory:/docker/x\n4:cpu,cpuacct:/docker/x\n0::/\n"
    assert cgroup_quota(text, tmp_path) == pytest.approx(3.0)
    _write(folder / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_quota(text, tmp_path) is None
    assert cgroup_quota("", tmp_path / "nothing") is None
    assert cgroup_quota("garbage\n1:cpu:\n", tmp_path) is None


def test_read_cpu_state_from_injected_files(tmp_path):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc / "self" / "cgroup", "0::/job\n")
    _write(root / "job" / "cpu.max", "200000 100000\n")
    _write(proc / "stat", STAT.format(a=1, b=1, ia=1, ib=1, steal=0))
    _write(root / "job" / "cpu.max", "150000 100000\n")
    state = threads.read_cpu_state(proc=proc, cgroup_root=root, affinity=range(8), window=0.0)
    assert (state.affinity, state.quota, state.usable, state.busy) == (8, 1.5, 1, None)  # 1 CPU: not sampled
    assert default_threads(state) == 1
    _write(root / "job" / "cpu.max", "200000 100000\n")
    state = threads.read_cpu_state(proc=proc, cgroup_root=root, affinity=range(8), window=0.0)
    assert (state.usable, state.busy) == (2, 0.0)  # 2 CPUs: sampled, nothing busy in the unchanged file
    assert default_threads(state) == min(2, state.torch_default)
    _write(root / "job" / "cpu.max", "max 100000\n")
    state = threads.read_cpu_state(proc=proc, cgroup_root=root, affinity=range(8), window=0.0)
    assert (state.usable, state.busy) == (8, 0.0)  # sampled (nothing changed in the file: 0 busy)
    assert default_threads(state) == min(7, state.torch_default)


# ---------------------------------------------------------------------------------------------
# Precedence, validation, restoring


def test_precedence_of_option_environment_user_setting_default(monkeypatch):
    monkeypatch.setattr(threads, "TORCH_THREADS_AT_IMPORT", 2)  # torch's count when specmerge was imported
    state = CpuState(affinity=16)
    assert choose_threads(3, state=state, environ={}) == threads.ThreadChoice(3, "threads option")
    chosen = choose_threads(None, state=state, environ={"OMP_NUM_THREADS": "4"}, current=4)
    assert (chosen.threads, chosen.source) == (4, "OMP_NUM_THREADS=4")
    chosen = choose_threads(None, state=state, environ={"MKL_NUM_THREADS": "2,1"}, current=2)
    assert (chosen.threads, chosen.source) == (2, "MKL_NUM_THREADS=2")
    chosen = choose_threads(None, state=state, environ={"OMP_NUM_THREADS": "junk"})
    assert chosen.threads == 15 and chosen.source.startswith("default")  # ignored, as OpenMP ignores it
    chosen = choose_threads(None, state=state, environ={"OMP_NUM_THREADS": "4"}, current=3)  # then set to 3
    assert (chosen.threads, chosen.source) == (3, "torch.set_num_threads")
    torch.set_num_threads(threads.TORCH_THREADS_AT_IMPORT + 1)  # the user's own choice: kept
    chosen = choose_threads(None, state=state, environ={})
    assert (chosen.threads, chosen.source) == (threads.TORCH_THREADS_AT_IMPORT + 1, "torch.set_num_threads")
    assert choose_threads(2, state=state, environ={}).threads == 2  # the option still wins


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2", 10**9])
def test_bad_thread_counts_are_refused(value):
    with pytest.raises(RecipeError, match="threads must be"):
        threads.check_threads(value)


@pytest.mark.parametrize("text", ["0", "-1", "abc", "1.5", "", " ", "99999999999"])
def test_bad_cli_thread_counts_are_refused(text):
    with pytest.raises(RecipeError, match="--threads"):
        threads.parse_threads(text)
    assert threads.parse_threads(" 3 ") == 3


def test_merge_threads_sets_and_restores_also_on_error():
    torch.set_num_threads(2)
    with merge_threads(1) as choice:
        assert choice.threads == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(KeyError), merge_threads(3):
        assert torch.get_num_threads() == 3
        raise KeyError("boom")
    assert torch.get_num_threads() == 2


def test_reader_and_writer_threads_compute_with_one_thread_only_inside_a_merge():
    torch.set_num_threads(3)
    with ThreadPoolExecutor(1, initializer=threads.io_thread_setup) as pool:  # outside: nothing changes
        assert pool.submit(torch.get_num_threads).result() == 3
    with merge_threads(2):
        with ThreadPoolExecutor(1, initializer=threads.io_thread_setup) as pool:
            assert pool.submit(torch.get_num_threads).result() == 1
        assert torch.get_num_threads() == 2  # the merging thread keeps its count
    assert torch.get_num_threads() == 3
    with ThreadPoolExecutor(1) as pool:  # threads started later get the count from before the merge
        assert pool.submit(torch.get_num_threads).result() == 3


# ---------------------------------------------------------------------------------------------
# merge(), run, inspect, the command line


def _record_threads(monkeypatch, module, name, fail=False):
    """Wrap ``module.name`` (a function, or a method of a class) to record torch's thread count while it runs (and
    raise after it, with ``fail``)."""
    seen = []
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        seen.append(torch.get_num_threads())
        if fail:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return seen


def test_merge_applies_threads_and_restores(llama, tmp_path, monkeypatch):
    base, experts = llama
    torch.set_num_threads(2)
    seen = _record_threads(monkeypatch, StreamingExecutor, "run")
    report = merge(base, experts, tmp_path / "a", method="task_arithmetic", progress=False, threads=3)
    assert seen == [3] and report["threads"] == 3 and report["threads_from"] == "threads option"
    assert json.loads((tmp_path / "a" / "report.json").read_text())["threads"] == 3
    assert torch.get_num_threads() == 2


def test_merge_default_threads_come_from_the_cpu_state(llama, tmp_path, monkeypatch):
    base, experts = llama
    torch.set_num_threads(2)
    monkeypatch.setattr(threads, "TORCH_THREADS_AT_IMPORT", 2)
    monkeypatch.setattr(threads, "read_cpu_state", lambda: CpuState(affinity=6, busy=1.0))
    seen = _record_threads(monkeypatch, StreamingExecutor, "run")
    report = merge(base, experts, tmp_path / "a", method="ties", progress=False)
    assert seen == [4] and report["threads"] == 4 and report["threads_from"].startswith("default: 6 usable CPUs")
    assert torch.get_num_threads() == 2


def test_merge_restores_threads_on_error(llama, tmp_path, monkeypatch):
    base, experts = llama
    torch.set_num_threads(2)
    seen = _record_threads(monkeypatch, StreamingExecutor, "run", fail=True)
    with pytest.raises(RuntimeError, match="injected"):
        merge(base, experts, tmp_path / "a", method="task_arithmetic", progress=False, threads=1)
    assert seen == [1] and torch.get_num_threads() == 2 and not (tmp_path / "a").exists()


def test_omp_num_threads_is_respected(llama, tmp_path, monkeypatch):
    base, experts = llama
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(threads, "read_cpu_state", lambda: CpuState(affinity=64))  # would give 63
    torch.set_num_threads(1)  # what torch did with OMP_NUM_THREADS=1 at start-up
    monkeypatch.setattr(threads, "TORCH_THREADS_AT_IMPORT", 1)
    report = merge(base, experts, tmp_path / "a", method="task_arithmetic", progress=False)
    assert (report["threads"], report["threads_from"]) == (1, "OMP_NUM_THREADS=1")


def test_inspect_applies_threads_and_records_them(llama, tmp_path, monkeypatch):
    base, experts = llama
    torch.set_num_threads(2)
    seen = _record_threads(monkeypatch, specmerge.diagnostics.run, "select_layers")
    summary = inspect_model(base, experts, tmp_path / "r", progress=False, plots=False, wudi=False, threads=1)
    assert seen == [1] and summary["threads"] == 1
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["threads"] == 1
    assert torch.get_num_threads() == 2


def test_cli_threads_option(llama, tmp_path, capsys):
    base, experts = llama
    args = ["merge", str(base), *map(str, experts), "-m", "task_arithmetic", "-q", "-o", str(tmp_path / "m")]
    assert main([*args, "--threads", "2"]) == 0
    assert json.loads((tmp_path / "m" / "report.json").read_text())["threads"] == 2
    recipe = tmp_path / "m" / "recipe.yaml"
    assert main(["run", str(recipe), "-q", "-o", str(tmp_path / "r"), "--threads", "1"]) == 0
    assert json.loads((tmp_path / "r" / "report.json").read_text())["threads"] == 1
    capsys.readouterr()


@pytest.mark.parametrize("value", ["0", "-1", "two"])
@pytest.mark.parametrize("command", ["merge", "run", "inspect"])
def test_cli_refuses_bad_threads_with_one_line(llama, tmp_path, capsys, command, value):
    base, experts = llama
    out = tmp_path / "out"
    if command == "run":
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(f"base: {base}\nexperts: [{experts[0]}, {experts[1]}]\nmethod: task_arithmetic\n")
        args = ["run", str(recipe)]
    else:
        args = [command, str(base), *map(str, experts)]
    assert main([*args, "-q", "-o", str(out), "--threads", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specmerge: error: --threads") and "Traceback" not in err
    assert not out.exists()
