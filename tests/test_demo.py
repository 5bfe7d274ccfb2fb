"""The demo: tiny Llama experts built on disk, merged from disk, scored against the experts."""

import pytest
import torch

import specmerge.demo as demo
from specmerge.cli import main


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    return demo.build_experts(root, n_experts=2)


def test_score_is_zero_for_the_expert_and_one_for_the_base(family):
    base, experts, _subspaces = family
    tokens = [torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    base_logits = [demo.model_logits(base, t) for t in tokens]
    expert_logits = [demo.model_logits(e, t) for e, t in zip(experts, tokens, strict=True)]
    assert demo.score(base, base_logits, expert_logits, tokens) == [1.0, 1.0]
    own = demo.score(experts[0], base_logits, expert_logits, tokens)
    assert own[0] == 0.0 and own[1] > 0


def test_experts_change_linear_weights_in_their_own_subspaces(family):
    from safetensors.torch import load_file

    base, experts, _subspaces = family
    w0 = load_file(base / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
    w1 = load_file(experts[0] / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
    s = torch.linalg.svdvals((w1 - w0).double())
    d_in = w0.shape[1]
    # a rank d_in / 8 update plus 5 % noise: the first d_in / 8 singular values carry most of the energy
    assert (s[: d_in // 8] ** 2).sum() / (s**2).sum() > 0.95


def test_demo_table_and_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(demo, "demo_methods", lambda: ["task_arithmetic", "swudi_a"])
    assert main(["demo", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "swudi_a" in out and "task_arithmetic" in out and "own-input interference" in out
    assert (tmp_path / "merged-swudi_a" / "report.json").exists()


def test_subspace_interference_is_zero_for_the_expert_and_one_for_the_base(family):
    base, experts, subspaces = family
    base_w, expert_w = demo.read_weights(base), [demo.read_weights(e) for e in experts]
    assert demo.subspace_interference(base, base_w, expert_w, subspaces) == [1.0, 1.0]
    own = demo.subspace_interference(experts[1], base_w, expert_w, subspaces)
    assert own[1] == 0.0 and own[0] > 0


def test_closed_form_family_beats_task_arithmetic_on_own_inputs(tmp_path):
    rows = {r["method"]: r for r in demo.run_demo(tmp_path, methods=["task_arithmetic", "swudi_a", "closed_form"])}
    assert rows["closed_form"]["interference"] < rows["task_arithmetic"]["interference"]
    assert rows["swudi_a"]["interference"] < rows["task_arithmetic"]["interference"]


def test_the_closing_hint_names_a_folder_that_exists_after_the_demo(tmp_path, capsys, monkeypatch):
    # issue 49: the hint named the temporary folder the demo had just removed
    monkeypatch.setattr(demo, "demo_methods", lambda: ["task_arithmetic"])
    monkeypatch.chdir(tmp_path)
    assert main(["demo"]) == 0
    hint = capsys.readouterr().out.split("Do one yourself")[1]
    assert "specmerge demo --workdir demo-models" in hint and "./demo-models/base ./demo-models/expert0" in hint
    assert "specmerge-demo-" not in hint  # never the removed temporary folder
    for _ in range(2):  # a second demo in the same folder replaces its own merges
        assert main(["demo", "--workdir", "kept"]) == 0
    hint = capsys.readouterr().out.split("Do one yourself")[-1]
    assert "specmerge merge ./kept/base ./kept/expert0 ./kept/expert1 ./kept/expert2 ./kept/expert3" in hint
    assert (tmp_path / "kept" / "base" / "config.json").is_file()
