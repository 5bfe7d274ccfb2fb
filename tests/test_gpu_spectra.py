"""The GPU's decomposition (issue 23): on a CUDA GPU with fast float64, a float32 layer's C is formed and
decomposed in float64 (``spectrum.float64_spectra``), for tall and wide layers alike.

CI has no GPU, so the route is switched on for the CPU here: it is the same code on any device. It must pass the
float32 accuracy sweep every float32 route passes (tests/test_float32_accuracy.py), keep float64's K, and give
the spectrum the SVD route would (accurate, min(N d_out, d_in) orthonormal directions).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from float32_sweep import BACKWARD_ERROR, METHODS, SHAPES, errors, label, layer
from specmerge.linalg import spectrum
from specmerge.linalg.quadratic import normal_equation
from specmerge.methods import get_method


@pytest.fixture
def float64_route(monkeypatch):
    monkeypatch.setattr(spectrum, "float64_spectra", lambda device: True)


@pytest.mark.parametrize(("capability", "fast"), [((9, 0), True), ((8, 0), True), ((8, 6), False), ((7, 5), False)])
def test_only_gpus_with_fast_float64_take_it(monkeypatch, capability, fast):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert spectrum.float64_spectra(torch.device("cuda")) is fast
    assert not spectrum.float64_spectra(torch.device("cpu"))


@pytest.mark.parametrize(("n", "shape", "conditioning"), list(itertools.product((2, 8), SHAPES, ("steeper", "spiked"))))
def test_it_passes_the_float32_accuracy_sweep(float64_route, n, shape, conditioning):
    failures = []
    for (method, params), e in zip(METHODS, errors(layer(n, shape, conditioning, seed=0), METHODS), strict=True):
        if not e.specmerge <= max(e.reference, BACKWARD_ERROR * e.allowance):
            failures.append(f"{label(method, params)}: {e.specmerge:.2e} > {e.reference:.2e}, {e.allowance:.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(("d_out", "d_in"), [(96, 64), (24, 256)])
def test_its_spectrum_is_the_accurate_one_and_keeps_float64s_k(float64_route, d_out, d_in):
    tau = layer(4, "tall" if d_out > d_in else "wide", "spiked", seed=1).float()
    eq = normal_equation(tau)
    s = spectrum.decompose(eq)
    m = min(4 * d_out, d_in)
    assert s.accurate and s.vectors.dtype == torch.float32 and s.vectors.shape == (d_in, m)
    eps = torch.finfo(torch.float32).eps
    assert (s.vectors.T @ s.vectors - torch.eye(m)).abs().max() < 4 * m**0.5 * eps  # the cast's rounding only
    exact = spectrum.decompose(normal_equation(tau.double()))
    top = float(exact.eigenvalues[0])
    assert (s.eigenvalues.double() - exact.eigenvalues).abs().max() <= 4 * eps * top
    for method in ("swudi_a", "swudi"):
        assert (
            get_method(method)(tau).diagnostics["kept_rank"]
            == get_method(method)(tau.double()).diagnostics["kept_rank"]
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none; run it where one is lent)")
def test_on_a_gpu_a_merge_is_as_close_to_float64_as_on_the_cpu():
    device = torch.device("cuda")
    if not spectrum.float64_spectra(device):
        pytest.skip(f"{torch.cuda.get_device_name(device)} runs float64 slowly and keeps float32")
    tau = layer(4, "wide", "spiked", seed=2).float()
    for method in ("swudi_a", "swudi"):
        exact = get_method(method)(tau.double())
        on_cpu, on_gpu = get_method(method)(tau), get_method(method)(tau.to(device))
        error = [float((r.delta.cpu().double() - exact.delta).norm() / exact.delta.norm()) for r in (on_cpu, on_gpu)]
        assert error[1] <= 3 * error[0] + 4 * torch.finfo(torch.float32).eps, (method, error)
        assert on_gpu.diagnostics["kept_rank"] == exact.diagnostics["kept_rank"]
