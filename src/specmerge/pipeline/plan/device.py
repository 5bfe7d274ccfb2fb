"""The device plan of a merge on a GPU: device memory per step, batch sizes that fit a budget, time (issue 50).

A spectral layer on a GPU holds, in device memory known before anything is read (N experts of a d_out x d_in layer,
compute dtype of e bytes, C and its eigenvectors in float64 where the device decomposes in float64,
:func:`~specmerge.linalg.spectrum.float64_spectra`; :func:`layer_steps`):

- **held** until its batch is done: the N task vectors (N d_out d_in e), C (d_in^2), its eigenvectors as kept, D
  where it is formed with C (d_out >= d_in), the output, and one expert's float64 copy while C is formed;
- **eigh**, at the decomposition: the stacked copy of C and the eigenvectors as eigh returns them (2 d_in^2), the
  eigenvalues, and once per batch the workspace of the symmetric divide-and-conquer eigensolver, (1 + 6 d + 2 d^2)
  entries and (3 + 5 d) integers (LAPACK's ``?syevd``; cuSOLVER's ``syevd`` asks for no more);
- **solve**, one layer at a time: the start, B, the columns B Q, the update, the merged tensor and the base on the
  device, and the float64 arrays of the per-direction round-off test;
- **staged**: the next batch's inputs, copied to the device while this batch computes (the executor's reader
  thread, :func:`~specmerge.pipeline.run.work.stage_inputs`).

A batch of B layers of one shape (:func:`~specmerge.pipeline.run.batched.merge_spectral_batch`) holds B x held, B x
staged, and the larger of B x eigh plus one workspace and one solve (:func:`batch_peak`; on the CPU, where the same
code runs, ``tests/test_device_plan.py`` holds this against the resident set a batch really reaches).
:func:`plan_device` gives each group of same-shape layers the largest batch (at most MAX_BATCH) whose peak fits the
budget; a layer whose peak alone does not fit is computed on the CPU, and the merge says so for that layer. Other
tensors (averages, kept tensors, elementwise methods) are small next to these and stream through one at a time.

Time per layer: the GEMM that forms C (2 N d_out d_in^2 flops, in float64 where the spectrum is), D and the solve
(about 4 N d_out d_in^2 flops in e), the eigendecomposition (interpolated in log-log between the sizes measured on
the device, cubic beyond), and the copies to and from the device. The rates come from :data:`KNOWN_DEVICES`: the
H200's are measured (BENCHMARKS.md, "The GPU: decompositions in float64"); the others are the H200's scaled by their
published float32 / float64 throughput and bandwidth, and say so. A plan made where there is no GPU
(``--device cuda --gpu-memory 80GiB --dry-run`` on a laptop) uses them too.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

GIB = 2**30
MAX_BATCH = 64  # layers decomposed together at most: beyond that a batch gains nothing on any GPU measured
MARGIN = 0.1  # share of the free device memory left to the allocator's fragmentation and the CUDA context
MIN_MARGIN = 1 * GIB


@dataclass(frozen=True)
class DeviceRates:
    """What one GPU does per second, and where the figures come from.

    ``eigh``: seconds of a symmetric eigendecomposition with eigenvectors at the sizes measured, (d, seconds) in
    float64 (the data-centre GPUs decompose float32 layers in float64); ``matmul64`` / ``matmul32``: GEMM flop/s;
    ``copy``: host-device bytes/s (pinned memory); ``memory``: the device memory in bytes."""

    name: str
    memory: int
    matmul32: float
    matmul64: float
    eigh: tuple[tuple[int, float], ...]
    copy: float
    source: str
    float64_spectra: bool = True

    def eigh_seconds(self, d: int) -> float:
        """The eigendecomposition of a d x d matrix: log-log interpolation between the measured sizes, cubic past
        the largest and linear below the smallest (launch-bound there)."""
        points = sorted(self.eigh)
        if d <= points[0][0]:
            return points[0][1] * d / points[0][0]
        if d >= points[-1][0]:
            return points[-1][1] * (d / points[-1][0]) ** 3
        for (d0, t0), (d1, t1) in itertools.pairwise(points):
            if d0 <= d <= d1:
                share = math.log(d / d0) / math.log(d1 / d0)
                return math.exp(math.log(t0) + share * math.log(t1 / t0))
        raise AssertionError("unreachable")

    def scaled(self, name: str, memory: int, fp32: float, fp64: float, copy: float, fast64: bool) -> DeviceRates:
        """Another GPU's rates from this one's, scaled by published throughput: float32 and float64 GEMM by their
        peak ratios, the eigendecomposition by the float64 ratio (or float32's where float64 is slow and the device
        decomposes in float32), copies by the link."""
        ratio64, ratio32 = fp64 / H200_SPEC[1], fp32 / H200_SPEC[0]
        eigh_ratio = ratio64 if fast64 else ratio32
        return DeviceRates(
            name, memory, self.matmul32 * ratio32, self.matmul64 * ratio64,
            tuple((d, t / eigh_ratio) for d, t in self.eigh), copy,
            f"scaled from the H200's measured rates by published throughput (float32 {fp32:g}, float64 {fp64:g} "
            "TFLOP/s): not measured", fast64,
        )  # fmt: skip


# The H200, measured (BENCHMARKS.md "The GPU: decompositions in float64", bench/compute_floor_gpu.sh): eigh in float64
# 0.01 s at 768, 0.06 s at 3072, 0.66 s at 8192, 3.26 s at 18944; C of the Qwen2-7B down_proj (2 x 14336 x 18944^2
# flops) in 0.19 s and of the 3B one in 0.03 s: about 55 TFLOP/s. Host-device copies: PCIe 5 x16, 50 GB/s pinned
# (assumed, not measured).
H200_SPEC = (67.0, 34.0)  # published dense float32 / float64 (non-tensor) TFLOP/s, for scaling the others
H200 = DeviceRates(
    "H200", 141 * 10**9, 55e12, 55e12, ((768, 0.01), (3072, 0.06), (8192, 0.66), (18944, 3.26)), 50e9,
    "measured on an H200 (BENCHMARKS.md, the GPU table of issue 23); host-device copies assumed 50 GB/s",
)  # fmt: skip
KNOWN_DEVICES: dict[str, DeviceRates] = {
    "H200": H200,
    "H100": H200.scaled("H100", 80 * 10**9, 67.0, 34.0, 50e9, True),
    "A100": H200.scaled("A100", 80 * 10**9, 19.5, 9.7, 25e9, True),
    "L40S": H200.scaled("L40S", 48 * 10**9, 91.6, 1.4, 25e9, False),
    "RTX4090": H200.scaled("RTX4090", 24 * 10**9, 82.6, 1.3, 25e9, False),
}


def known_device(name: str) -> DeviceRates:
    """The rates of a GPU by name, as ``torch.cuda.get_device_name`` spells it or short ("NVIDIA H100 80GB HBM3",
    "h100"); the H200's when the name is not in the table (the caller says so)."""
    wanted = name.upper().replace(" ", "").replace("-", "")
    for key, rates in KNOWN_DEVICES.items():
        if key in wanted:
            return rates
    return H200


@dataclass(frozen=True)
class LayerShape:
    """One group of same-shape spectral layers: ``count`` layers of N experts of d_out x d_in."""

    n: int
    d_out: int
    d_in: int
    count: int
    names: tuple[str, ...] = ()


def eigh_workspace(d: int, itemsize: int) -> int:
    """Bytes of ``?syevd``'s workspace for a d x d matrix: lwork = 1 + 6 d + 2 d^2 entries, liwork = 3 + 5 d ints."""
    return (1 + 6 * d + 2 * d * d) * itemsize + (3 + 5 * d) * 4


ROUNDING_ARRAYS, ROUNDING_CHUNK = 5, 1024  # the round-off test's float64 temporaries alive at once, rows per chunk


def layer_steps(shape: LayerShape, itemsize: int, out_itemsize: int, float64: bool) -> dict[str, int]:
    """Device bytes of one layer, by what holds them (see the module docstring): ``held`` while its batch runs (the
    stack, C, the eigenvectors kept, D where it is formed with C, the output), ``eigh`` at the batched
    decomposition on top (the stacked copy of C and the eigenvectors as eigh returns them, before they are ordered),
    ``solve`` while one layer of the batch is solved (the start, B, the columns B Q, the update, the merged tensor,
    the base on the device, and the float64 arrays of the per-direction round-off test, ROUNDING_ARRAYS of
    min(ROUNDING_CHUNK, m) x m for m kept directions: :func:`~specmerge.linalg.solve._rounding_level`)."""
    n, d_out, d_in = shape.n, shape.d_out, shape.d_in
    x = d_out * d_in
    spectral = 8 if float64 else itemsize
    c = d_in * d_in * spectral
    kept_vectors = d_in * min(n * d_out, d_in) * itemsize if float64 else d_in * d_in * itemsize
    d_with_c = x * itemsize if d_out >= d_in else 0
    m = min(n * d_out, d_in)  # the directions a filter may keep
    return {
        "held": n * x * itemsize + c + kept_vectors + d_with_c + x * out_itemsize + (x * 8 if float64 else 0),
        "eigh": 2 * c + d_in * spectral,
        "solve": 6 * x * itemsize + d_out * m * itemsize + ROUNDING_ARRAYS * min(ROUNDING_CHUNK, m) * m * 8,
        "staged": (n + 1) * x * itemsize,  # the next batch's inputs on the device, at most in the compute dtype
    }


def batch_peak(steps: dict[str, int], batch: int, d_in: int, itemsize: int, *, staged: bool = False) -> int:
    """Device bytes of a batch of ``batch`` layers: every layer's ``held`` bytes, and the larger of the batched
    decomposition (each layer's ``eigh`` bytes and one workspace) and one layer's solve; with ``staged`` (a CUDA
    merge), also the next batch's inputs, copied to the device while this one computes."""
    ahead = batch * steps["staged"] if staged else 0
    return batch * steps["held"] + ahead + max(batch * steps["eigh"] + eigh_workspace(d_in, itemsize), steps["solve"])


@dataclass(frozen=True)
class GroupPlan:
    """How one group of same-shape layers runs: ``batch`` layers at a time on the device (0: on the CPU), each
    batch's peak device bytes, and the group's estimated seconds."""

    shape: LayerShape
    batch: int
    peak: int
    seconds: float
    steps: dict[str, int] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return "cpu" if self.batch == 0 else "device"


@dataclass(frozen=True)
class DevicePlan:
    """The device plan of a merge: the budget, the rates used and each group's plan."""

    device: str
    budget: int
    budget_from: str
    rates: DeviceRates
    groups: tuple[GroupPlan, ...]

    @property
    def peak(self) -> int:
        return max((g.peak for g in self.groups if g.batch), default=0)

    @property
    def seconds(self) -> float:
        return sum(g.seconds for g in self.groups if g.batch)

    def batch_for(self, shape: tuple[int, int], n: int) -> int:
        """The batch size of layers of this shape and expert count (1 when the plan has no such group)."""
        for g in self.groups:
            if (g.shape.d_out, g.shape.d_in, g.shape.n) == (*shape, n):
                return g.batch
        return 1

    def cpu_layers(self) -> list[tuple[str, GroupPlan]]:
        """The layers computed on the CPU (their peak alone is over the budget), with their group's plan."""
        return [(name, g) for g in self.groups if g.batch == 0 for name in g.shape.names]

    def describe(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "budget_bytes": self.budget,
            "budget_from": self.budget_from,
            "rates": self.rates.name,
            "rates_from": self.rates.source,
            "peak_bytes": self.peak,
            "seconds": round(self.seconds, 3),
            "groups": [
                {
                    "shape": [g.shape.d_out, g.shape.d_in],
                    "experts": g.shape.n,
                    "layers": g.shape.count,
                    "batch": g.batch,
                    "where": g.where,
                    "peak_bytes": g.peak,
                    "seconds": round(g.seconds, 3),
                    "steps": g.steps,
                }
                for g in self.groups
            ],
        }


def layer_seconds(shape: LayerShape, rates: DeviceRates, itemsize: int, float64: bool) -> float:
    """One layer's estimated seconds on the device: C's GEMM, D and the solve, the eigendecomposition, copies."""
    n, d_out, d_in = shape.n, shape.d_out, shape.d_in
    gram = 2.0 * n * d_out * d_in * d_in / (rates.matmul64 if float64 else rates.matmul32)
    products = 4.0 * n * d_out * d_in * min(d_out, d_in) / rates.matmul32
    copies = ((n + 2) * d_out * d_in * itemsize) / rates.copy
    return gram + products + rates.eigh_seconds(d_in) + copies


def plan_device(
    shapes: Sequence[LayerShape],
    budget: int,
    rates: DeviceRates,
    *,
    itemsize: int = 4,
    out_itemsize: int = 2,
    device: str = "cuda",
    budget_from: str = "",
    max_batch: int = MAX_BATCH,
) -> DevicePlan:
    """Each group's batch size: the largest B <= min(count, max_batch) whose :func:`batch_peak` fits ``budget``;
    0 (the CPU) when one layer does not fit."""
    float64 = rates.float64_spectra and itemsize == 4
    spectral = 8 if float64 else itemsize
    groups = []
    for shape in shapes:
        steps = layer_steps(shape, itemsize, out_itemsize, float64)
        batch = min(shape.count, max_batch)
        while batch and batch_peak(steps, batch, shape.d_in, spectral, staged=True) > budget:
            batch -= 1
        seconds = shape.count * layer_seconds(shape, rates, itemsize, float64) if batch else 0.0
        peak = batch_peak(steps, max(batch, 1), shape.d_in, spectral, staged=True)
        workspace = eigh_workspace(shape.d_in, spectral)
        groups.append(GroupPlan(shape, batch, peak, seconds, {**steps, "eigh workspace": workspace}))
    return DevicePlan(device, budget, budget_from, rates, tuple(groups))


def default_budget(free: int) -> int:
    """The budget when none is given: the device's free memory less MARGIN of it (at least MIN_MARGIN)."""
    return max(0, free - max(MIN_MARGIN, int(MARGIN * free)))
