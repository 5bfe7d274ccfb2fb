"""The demo's synthetic problem and table."""

from specmerge.cli import main
from specmerge.demo import interference, run_demo, synthetic_layer


def test_interference_is_zero_for_each_expert_on_its_own_data_and_one_for_the_base():
    layer = synthetic_layer(n_experts=3, d_out=8, d_in=12, subspace_dim=3, n_samples=16)
    own = interference(layer.task_vectors[1], layer)
    assert own[1] == 0 and own[0] > 0
    assert interference(0 * layer.ideal, layer).tolist() == [1.0, 1.0, 1.0]


def test_demo_ranks_the_closed_form_family_ahead_of_task_arithmetic():
    rows = {r["method"]: r for r in run_demo()}
    assert rows["swudi_a"]["interference"] < rows["tsv_m"]["interference"] < rows["task_arithmetic"]["interference"]
    assert rows["swudi"]["kept_rank"] == 84  # ceil(0.65 * 128)


def test_demo_command_prints_a_table(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "swudi_a" in out and "interference" in out
