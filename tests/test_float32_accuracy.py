"""Float32 as accurate as the paper's algorithm in float32 (issue 13, items 19-20).

For every spectral method, on random layers of three shapes (tall, square, and wide with N d_out < d_in),
N in {2, 4, 8} and two hard conditionings (singular values over 5 decades; a shared rank-8 signal over a
1 % noise bulk), plus i.i.d. Gaussian experts at N = 4, specmerge's float32 result must be at least as
close to its own float64 result as our re-implementation of the paper's algorithm (``paper_reference``:
one eigh of C, h / lambda) is to its float64 result, on the same float32 numbers:

    err_specmerge <= max(err_reference, BACKWARD_ERROR * first_order_error)

The allowance is the first-order error any float32 code must be expected to make on that layer
(:func:`float32_sweep.first_order_error`: eps, the gains and their slopes, the eigengaps around a hard
cut, the rounding of D), times the backward-error constant the estimate leaves out; it matters only where
the reference happens to be luckier than that. Before this issue specmerge failed it on 73 of these
231 layer x method pairs, in 14 of the 21 layers (real eigen-directions dropped under SWUDI's bounded
gain, eigenvectors that lost orthogonality on wide layers). bench/float32_accuracy.py runs the full sweep.
"""

import itertools

import pytest
import torch

from float32_sweep import BACKWARD_ERROR, METHODS, SHAPES, errors, label, layer

# every N and shape with the two conditionings where float32 is hardest, and i.i.d. experts as a plain case
LAYERS = [*itertools.product((2, 4, 8), SHAPES, ("steeper", "spiked")), *((4, shape, "flat") for shape in SHAPES)]


@pytest.mark.parametrize(("n", "shape", "conditioning"), LAYERS)
def test_float32_is_at_least_as_accurate_as_the_paper_algorithm(n, shape, conditioning):
    failures = []
    for (method, params), e in zip(METHODS, errors(layer(n, shape, conditioning, seed=0), METHODS), strict=True):
        if not e.specmerge <= max(e.reference, BACKWARD_ERROR * e.allowance):
            failures.append(
                f"{label(method, params)}: specmerge {e.specmerge:.2e} > reference {e.reference:.2e}"
                f" and allowance {BACKWARD_ERROR * e.allowance:.2e}"
            )
    assert not failures, "\n".join(failures)


def test_allowance_is_the_size_of_the_error_not_a_blanket():
    """The allowance must stay well below the errors the defects produced, or the test above could not fail."""
    (e,) = errors(layer(2, "wide", "steep", seed=0), [("swudi", {"rank_ratio": 1.0, "t": 1300.0})])
    # before the fix specmerge was 5.0e-3 from its float64 result here, the reference 7.6e-5; the allowance is 1.2e-3
    assert BACKWARD_ERROR * e.allowance < 5.0e-3 / 2
    assert e.specmerge <= BACKWARD_ERROR * e.allowance
    assert torch.finfo(torch.float32).eps < e.allowance  # and above plain rounding: a real float32 problem
