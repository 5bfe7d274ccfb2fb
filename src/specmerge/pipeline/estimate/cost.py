"""The cost model of a merge: for every work item, what it reads and writes, the operations of its route, its
working memory, and its seconds; the dry run (:mod:`.dryrun`) prints them and the progress bar advances by them.

Per work item (:mod:`specmerge.pipeline.run.work`), before any tensor is read:

- **read**: the bytes of the base's tensor (or rows) and of every expert that changes it (a full checkpoint's
  tensor, a LoRA adapter's two factors), priced per input by the share of its files in the page cache
  (:func:`~specmerge.pipeline.estimate.calibrate.input_reads`): page-cache bytes at the mapped-read rate, the rest at
  the disk rate;
- **compute**: the route the executor will take (:func:`specmerge.pipeline.run.compute.route`, from the experts'
  kinds) and its operations: the chunked linear merge (priced by timing that very function), or the
  conversions, stack and checks of the dense route plus the method's declared operations
  (``register(..., cost=...)``, :mod:`specmerge.methods.operations`), or the factored route's QRs and products;
  priced with :class:`~specmerge.pipeline.estimate.calibrate.ComputeRates`;
- **write**: the output bytes, copied into the page cache and, with fsync, flushed at the disk write rate.

The streaming executor reads one item ahead and writes one behind on their own threads: an item takes the
longest of its disk read, its disk write and its CPU work, where the CPU work is compute + page-cache reads +
copies when torch's threads take every CPU (they then share them), or the longest of the three when a CPU is
left over. The merge's estimate is the sum over items. Peak memory follows the executor too: the inputs of the
item computed and of the one read ahead (mapped pages count in the resident set), the compute's working set
(input conversions, the N x ... stack, the method's workspace), the output being written and the one just made,
plus the process's own resident set (torch and specmerge imported).

What the model does not know: ranks a rank rule keeps (assumed; the method's ``assumed`` text says what), other
processes taking CPUs or disk while the merge runs, the disk's write rate (assumed,
:data:`~specmerge.pipeline.estimate.calibrate.DISK_RATE`), and allocator overheads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from specmerge.io.formats.protocol import TensorSource
from specmerge.io.views.experts import Expert
from specmerge.linalg import eigensolver
from specmerge.methods import get_method
from specmerge.methods.operations import Operations, passes
from specmerge.pipeline.estimate.calibrate import ComputeRates, InputReads, input_reads, rates_now
from specmerge.pipeline.plan.rules import TensorPlan
from specmerge.pipeline.run.compute import CHUNK_ELEMENTS, route
from specmerge.pipeline.run.work import WorkItem

BASE = "base"  # the base's label among the inputs
F64 = 8  # bytes per float64 entry (the factored route's bases and small solve)
UNDECLARED = "a method that declares no cost: counted as N + 4 passes"


@dataclass(frozen=True)
class ItemCost:
    """The estimate of one work item: its route, bytes read (by input label) and written, the operations and working
    memory of its compute, and the seconds of each part (:attr:`seconds` combines them as the executor overlaps)."""

    item: WorkItem
    route: str
    reads: Mapping[str, int]
    write: int
    operations: Operations
    working: int  # peak bytes of the compute beyond its inputs and output
    read_cached_s: float
    read_disk_s: float
    compute_s: float
    write_copy_s: float
    write_disk_s: float
    overlap: bool  # a CPU is left for the reader and writer threads (their CPU work overlaps the compute)

    @property
    def read_bytes(self) -> int:
        return sum(self.reads.values())

    @property
    def cpu_s(self) -> float:
        parts = (self.compute_s, self.read_cached_s, self.write_copy_s)
        return max(parts) if self.overlap else sum(parts)

    @property
    def seconds(self) -> float:
        """The item's share of the merge's time: the longest of its CPU work, disk read and disk write."""
        return max(self.cpu_s, self.read_disk_s, self.write_disk_s)


def expert_kind(expert: Expert, name: str) -> str:
    """The kind of task vector ``expert`` gives for tensor ``name`` (as :mod:`specmerge.io.views.task_vectors` names
    them), known before reading: ``zero`` where it does not change it, else ``low_rank`` or ``dense``."""
    kind = getattr(expert, "kind", None)  # an adapter says, tensor by tensor (DoRA, saved modules: dense)
    if kind is not None:
        return kind(name)
    if not expert.changes(name):
        return "zero"
    return "low_rank" if expert.low_rank else "dense"


def lora_rank(expert: Expert, name: str) -> tuple[int, int]:
    """(rank, bytes per factor entry) of the LoRA factors an adapter expert holds for ``name`` ((0, 0): none)."""
    adapter = getattr(expert, "adapter", None)
    module = None if adapter is None else adapter.modules().get(name)
    return (0, 0) if module is None else (module.rank, adapter.dtype.itemsize)


def expert_read_bytes(expert: Expert, name: str, rows: tuple[int, int] | None) -> int:
    """Bytes ``expert`` reads for tensor ``name`` (its rows ``start:stop``): a checkpoint's stored tensor, an
    adapter's two factors (whole: a block of rows takes the rows of B after reading it), nothing where it
    changes nothing."""
    kind = expert_kind(expert, name)
    if kind == "zero":
        return 0
    if kind == "low_rank":
        rank, itemsize = lora_rank(expert, name)
        shape = expert.infos()[name].shape
        return rank * (shape[0] + shape[1]) * itemsize
    info = expert.infos()[name]
    return _rows_share(info.shape, rows, math.prod(info.shape) * info.dtype.itemsize)


def _rows_share(shape: Sequence[int], rows: tuple[int, int] | None, nbytes: int) -> int:
    if rows is None or not shape or not shape[0]:
        return nbytes
    return nbytes * (rows[1] - rows[0]) // shape[0]


def item_shape(item: WorkItem) -> tuple[int, ...]:
    """The shape of the tensor or block of rows the item computes."""
    shape = item.entry.shape
    return shape if item.rows is None else (item.rows[1] - item.rows[0], *shape[1:])


def method_operations(entry: TensorPlan, stack: tuple[int, ...], itemsize: int) -> Operations:
    """The declared operations of the entry's method on a stack of ``stack`` (oriented (out, in) for a matrix
    method on a Conv1D weight), or a few passes with the assumption said when it declares none."""
    method = get_method(entry.method)
    ops = method.operations(stack, itemsize, entry.params)
    if ops is None:
        return passes(stack[0] + 4, math.prod(stack[1:]), itemsize) + Operations(assumed=(UNDECLARED,))
    return ops


def route_operations(
    entry: TensorPlan,
    which: str,
    shape: tuple[int, ...],
    kinds: Sequence[str],
    ranks: Sequence[int],
    *,
    in_size: int,
    out_size: int,
    itemsize: int,
) -> Operations:
    """The operations of computing one item of ``shape`` by route ``which`` (all but ``linear``, which is priced by
    timing it), from the base's entry size ``in_size``, the output's ``out_size`` and the compute dtype's
    ``itemsize``; ``ranks`` are the LoRA ranks of the experts (0 for the others)."""
    x, e, n = math.prod(shape), itemsize, len(kinds)
    base = passes(1, x, in_size + e) + passes(1, x, e)  # W_0 converted to the compute dtype, and checked
    finish = passes(1, x, e + out_size)  # the merged tensor cast to the output dtype
    if which == "keep_base":
        return passes(1, x, in_size) + (passes(1, x, in_size + out_size) if in_size != out_size else Operations())
    if which == "unchanged":
        return base + finish + Operations(workspace=x * e)
    dense_in = sum(1 for kind in kinds if kind == "dense")
    lora = Operations(matmul=2.0 * x * sum(ranks), memory=2.0 * x * e * sum(1 for r in ranks if r))
    if which == "sum":
        add = passes(dense_in, x, in_size + 2 * e) + lora + passes(6, x, e)  # sum, W_0 out, scale, finite
        return base + add + passes(3, x, e) + finish + Operations(workspace=3 * x * e)
    if which == "factored":
        factored = _factored(entry, shape, ranks, e)
        return base + factored + passes(3, x, e) + finish + Operations(workspace=factored.workspace + x * e)
    stack = (n, *shape)
    fill = passes(dense_in, x, in_size + 4 * e) + lora + passes(n, x, e)  # W_i converted, W_0 out; finite check
    oriented = (n, *shape[::-1]) if entry.transposed and len(shape) == 2 else stack
    if entry.stacked and len(shape) == 3:  # E linear layers, one after the other
        one = (n, *shape[:0:-1]) if entry.transposed else (n, *shape[1:])
        merging = method_operations(entry, one, e).times(shape[0])
    else:
        merging = method_operations(entry, oriented, e)
    ops = base + fill + merging + passes(4, x, e) + finish  # norm, + W_0
    return ops + Operations(workspace=ops.workspace + (n + 2) * x * e)


def _factored(entry: TensorPlan, shape: tuple[int, ...], ranks: Sequence[int], e: int) -> Operations:
    """The factored route: an average's concatenated factors, or the bases of the factors (SVDs in float64), the
    cores, the method on them and the products back; then W_0 + L R (one product d_out x d_in x R)."""
    d_out, d_in = shape
    total = sum(ranks)
    add = Operations(matmul=2.0 * d_out * d_in * total)
    if entry.action == "average":
        return add
    bases = Operations(svd=((1, d_out, total), (1, d_in, total)), memory=2.0 * (d_out + d_in) * total * F64)
    cores = Operations(matmul=2.0 * sum(r * (d_out + d_in) * total for r in ranks) + 2.0 * len(ranks) * total**3)
    on_cores = method_operations(entry, (len(ranks), total, total), F64)
    back = Operations(matmul=2.0 * d_out * total * total)
    return bases + cores + on_cores + back + add


def price(ops: Operations, rates: ComputeRates) -> float:
    """Seconds of ``ops`` at the machine's rates (each rate probed on first use)."""
    seconds = ops.matmul / rates.matmul if ops.matmul else 0.0
    seconds += sum(rates.eigh_seconds(d) for d in ops.eigh)
    seconds += sum(rates.eigh_seconds(d) * eigensolver.cost_share(k, d) for d, k in ops.partial_eigh)
    seconds += sum(count * max(m, n) * min(m, n) ** 2 * rates.svd for count, m, n in ops.svd)
    seconds += sum((4 * m * n * n - 4 / 3 * n**3) / rates.qr for m, n in ops.qr)
    seconds += ops.memory / rates.memory if ops.memory else 0.0
    seconds += ops.select / rates.select if ops.select else 0.0
    seconds += ops.random / rates.random if ops.random else 0.0
    return seconds


def item_costs(
    items: Sequence[WorkItem],
    base: TensorSource | None,
    experts: Mapping[str, Expert],
    *,
    device: torch.device,
    compute_dtype: torch.dtype,
    rates: ComputeRates,
    reads: InputReads,
    overlap: bool,
    fsync: bool = True,
    write_output: bool = True,
) -> list[ItemCost]:
    """The estimate of every work item, in order. The base is labelled :data:`BASE` in ``reads`` (``base`` None:
    the job does not read it, as for an adapter output); ``experts`` by their labels there, in recipe order.
    ``write_output`` False: the items' outputs stay in memory (an adapter is written at the end)."""
    costs = []
    e = compute_dtype.itemsize
    stored = {} if base is None else base.infos()
    for item in items:
        entry, shape = item.entry, item_shape(item)
        keep = entry.action == "keep_base"
        kinds = [] if keep else [expert_kind(x, entry.name) for x in experts.values()]
        which = route(entry, kinds, device, chunked=base is not None)
        size = _rows_share(entry.shape, item.rows, math.prod(entry.shape) * entry.out_dtype.itemsize)
        in_size = stored[entry.name].dtype.itemsize if entry.name in stored else entry.out_dtype.itemsize
        read = {}
        if base is not None:
            read[BASE] = _rows_share(entry.shape, item.rows, math.prod(entry.shape) * in_size)
        if not keep:
            read.update({label: expert_read_bytes(x, entry.name, item.rows) for label, x in experts.items()})
        ranks = [
            lora_rank(x, entry.name)[0] if kind == "low_rank" else 0
            for x, kind in zip(*_matched(experts, kinds), strict=True)
        ]
        if which == "linear":
            ops = Operations(memory=float(sum(read.values()) + size), workspace=3 * CHUNK_ELEMENTS * e)
            compute_s = ops.memory / rates.linear
        else:
            ops = route_operations(
                entry, which, shape, kinds, ranks, in_size=in_size, out_size=entry.out_dtype.itemsize, itemsize=e
            )
            compute_s = price(ops, rates)
        working = int(ops.workspace)
        cached = disk = 0.0
        for label, nbytes in read.items():
            c, d = reads.seconds(label, nbytes)
            cached, disk = cached + c, disk + d
        written = size if write_output else 0
        copy = written / rates.fresh if written else 0.0  # the writer's copy into new page-cache pages
        flush = written / reads.write_rate if (written and fsync) else 0.0
        costs.append(ItemCost(item, which, read, written, ops, working, cached, disk, compute_s, copy, flush, overlap))
    return costs


def _matched(experts: Mapping[str, Expert], kinds: Sequence[str]) -> tuple[list[Expert], list[str]]:
    """The experts and their kinds, or two empty lists for an item that reads no expert (``keep_base``)."""
    return (list(experts.values()), list(kinds)) if kinds else ([], [])


def peak_memory(costs: Sequence[ItemCost], baseline: int = 0) -> tuple[int, int]:
    """(peak bytes, index of the item where it is reached): ``baseline`` plus, while item k computes, its inputs and
    those of item k + 1 (read ahead), its working memory, its output and item k - 1's (being written)."""
    best, where = 0, 0
    for k, cost in enumerate(costs):
        ahead = costs[k + 1].read_bytes if k + 1 < len(costs) else 0
        behind = costs[k - 1].write if k else 0
        live = cost.read_bytes + ahead + cost.working + cost.write + behind
        if live > best:
            best, where = live, k
    return baseline + best, where


def spare_cpu(threads: int | None = None) -> bool:
    """Whether a CPU is left beside torch's ``threads`` (default: its count now) for the reader and writer threads."""
    from specmerge.pipeline.run.threads import read_cpu_state

    threads = torch.get_num_threads() if threads is None else threads
    return read_cpu_state(sample_busy=False).usable > threads


def expert_labels(count: int, keys: Sequence[str] | None = None) -> list[str]:
    """The experts' labels in an estimate: their keys, or ``expert 0``, ``expert 1``, ..."""
    return list(keys) if keys else [f"expert {i}" for i in range(count)]


def estimate_items(
    items: Sequence[WorkItem],
    base: TensorSource | None,
    experts: Sequence[Expert],
    *,
    device: torch.device,
    compute_dtype: torch.dtype,
    expert_keys: Sequence[str] | None = None,
    fsync: bool = True,
    write_output: bool = True,
    probe: bool = True,
) -> tuple[list[ItemCost], ComputeRates, InputReads]:
    """:func:`item_costs` with this machine's rates for torch's thread count now (probed on first use, kept for the
    process) and the inputs' page-cache state and read rates (``probe`` False: residency only, rates assumed)."""
    labelled = dict(zip(expert_labels(len(experts), expert_keys), experts, strict=True))
    files = {label: expert.files() for label, expert in labelled.items()}
    if base is not None:
        files = {BASE: base.files(), **files}
    reads = input_reads(files, probe=probe)
    rates = rates_now(device)
    costs = item_costs(
        items,
        base,
        labelled,
        device=device,
        compute_dtype=compute_dtype,
        rates=rates,
        reads=reads,
        overlap=spare_cpu(),
        fsync=fsync,
        write_output=write_output,
    )
    return costs, rates, reads
