"""The accuracy benchmark's rows come from the registry: the same candidates as the hand-kept list they
replace, and a newly registered method appears in them (and in the demo) without a change elsewhere."""

import pytest
import torch

import specmerge
import specmerge.demo as demo
from specmerge.methods import LayerResult, Setting, registry
from specmerge_bench import speed
from specmerge_bench.accuracy.merging import Candidate
from specmerge_bench.accuracy.rows import method_rows, step_rows

R, T = (0.55, 0.65, 0.75, 0.85), (300.0, 800.0, 1300.0, 1800.0)
# The main table as the benchmark hand-kept it before the rows came from the methods' settings (label, title,
# method, candidate parameters): every cached score is keyed by these candidates, so they must not change.
BEFORE = [
    ("weight_average", "Weight average", "weight_average", [{}]),
    ("task_arithmetic", "Task arithmetic", "task_arithmetic", [{}]),
    ("ties", "TIES (top 20 %)", "ties", [{}]),
    ("dare_task_arithmetic", "DARE-TA (p = 0.5)", "dare_task_arithmetic", [{}]),
    ("dare_ties", "DARE-TIES (p = 0.5)", "dare_ties", [{}]),
    ("tsv_m", "TSV-M", "tsv_m", [{}]),
    ("iso_c", "Iso-C", "iso_c", [{}]),
    ("closed_form", "D C⁺ (closed form)", "closed_form", [{}]),
    ("wudi", "WUDI (Adam, 300 steps)", "wudi", [{"steps": 300}]),
    ("optmerge", "OptMerge (300 steps)", "optmerge", [{}]),
    ("swudi", "SWUDI (r, t on val)", "swudi", [{"rank_ratio": r, "t": t} for r in R for t in T]),
    ("swudi_a_psqrt", "SWUDI-A (psqrt)", "swudi_a", [{"rule": "psqrt"}]),
    ("swudi_a_gd", "SWUDI-A (Gavish–Donoho)", "swudi_a", [{"rule": "gavish_donoho"}]),
    ("exponential", "Exponential filter, no truncation (t on val)", "spectral_filter",
     [{"filter": "exponential", "t": t} for t in T]),
]  # fmt: skip


def test_rows_reproduce_the_hand_kept_table_candidate_for_candidate():
    before = [label for label, *_ in BEFORE]
    assert [row.label for row in method_rows() if row.label in before] == before  # the same order
    rows = {row.label: row for row in method_rows()}
    for label, title, method, params in BEFORE:
        row = rows[label]
        assert row.title == title
        assert row.candidates == tuple(Candidate(label, method, p) for p in params)  # same keys, same grid order
    assert [row.label for row in step_rows()][-1] == "closed_form"


def test_grids_can_be_narrowed_for_a_run():
    rows = {r.label: r for r in method_rows(grids={"swudi": {"t": (300.0,)}})}
    assert [dict(c.params) for c in rows["swudi"].candidates] == [{"rank_ratio": r, "t": 300.0} for r in R]


def _band_average(task_vectors: torch.Tensor, *, scale: float = 1.0) -> LayerResult:
    """Mean of the task vectors, scaled (a stand-in for a user's new method).

    Args:
        scale: factor on the merged delta.
    """
    return LayerResult(scale * task_vectors.mean(dim=0), {})


@pytest.fixture
def new_method():
    """A method registered the way a plugin would be, removed from the registry after the test."""
    settings = [Setting("band_average", "Band average (s on val)"), Setting("band_half", "Band, half", {"scale": 0.5})]
    with registry.registrations():
        yield specmerge.register("band_average", citation="test", title="Band average", needs_matrix=False,
                                 settings=settings)(_band_average)  # fmt: skip


def test_a_registered_method_is_benchmarked_demoed_and_timed_without_other_changes(new_method):
    rows = {row.label: row for row in method_rows()}
    assert rows["band_average"].candidates == (Candidate("band_average", "band_average", {}),)
    assert rows["band_half"].candidates == (Candidate("band_half", "band_average", {"scale": 0.5}),)
    assert rows["band_average"].title == "Band average (s on val)"
    assert "band_average" in demo.demo_methods()
    columns = speed.entries()
    assert columns["band_half"].method == "band_average" and not columns["band_half"].iterative
