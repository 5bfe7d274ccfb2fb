"""AdaMerging on top of a merge (issue 17): the coefficients' start is the merge bit for bit, the loss is the mean
prediction entropy worked out by hand, only the coefficients learn, the groups follow the layer rule, and the
folder function and ``specmerge adamerge`` write a complete model folder or nothing."""

from __future__ import annotations

import copy
import hashlib
import json
import math

import pytest
import torch
import transformers
from safetensors.torch import load_file

import specmerge
from specmerge.cli import main
from specmerge.errors import SpecmergeError
from specmerge.tuning import adamerge_io
from specmerge.tuning.adamerge import OTHER, adamerge, adamerge_coefficients, entropy_sum, layer_groups
from tiny_models import build_family, llama_config
from token_models import example

QUIET = {"progress": False}


def perturbed(state: dict, seed: int, size: float, skip: str = "norm") -> dict:
    """``state`` with every floating tensor but those named ``*skip*`` moved by ``size`` times its own std."""
    g = torch.Generator().manual_seed(seed)
    return {
        name: value if skip in name else value + size * value.std() * torch.randn(value.shape, generator=g)
        for name, value in state.items()
    }


@pytest.fixture(scope="module")
def lm():
    """A tiny Llama with peaked predictions (init std 0.2), its base state, two experts, their task-arithmetic
    merge (norms left unchanged) and three batches of random tokens, the last one right-padded."""
    config = llama_config()
    config.initializer_range = 0.2
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    base = {name: value.clone() for name, value in model.state_dict().items()}
    experts = [perturbed(base, seed, 0.3) for seed in (1, 2)]
    merged = {name: base[name] + 0.5 * sum(e[name] - base[name] for e in experts) for name in base}
    g = torch.Generator().manual_seed(3)
    batches = [{"input_ids": torch.randint(0, 64, (4, 10), generator=g)} for _ in range(3)]
    for batch in batches:
        batch["attention_mask"] = torch.ones(4, 10, dtype=torch.long)
    batches[-1]["attention_mask"][:, 7:] = 0
    return transformers.LlamaForCausalLM(config).eval(), base, merged, experts, batches  # other weights than base


def hashes(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


# --- the math ----------------------------------------------------------------------------------------------------


def test_zero_steps_is_the_merge_bit_for_bit(lm):
    model, base, merged, experts, batches = lm
    for given in (None, experts):
        result = adamerge_coefficients(model, base, merged, batches, experts=given, steps=0, **QUIET)
        state = result.state(base, merged, given)
        assert state.keys() == merged.keys()
        assert all(state[k].dtype == merged[k].dtype and torch.equal(state[k], merged[k]) for k in merged)
        assert result.losses == [] and result.entropy_end == result.entropy_start
    half = {name: value.to(torch.bfloat16) for name, value in merged.items()}  # the merge written in bfloat16
    state = adamerge_coefficients(model, base, half, batches, steps=0, **QUIET).state(base, half)
    assert all(state[k].dtype == torch.bfloat16 and torch.equal(state[k], half[k]) for k in half)


def test_the_start_is_the_merged_model_and_the_loss_its_masked_mean_entropy(lm):
    """entropy_start is the merged model's own (its weights loaded, not the module's), averaged by hand over the
    unmasked positions of every batch; the first loss is that of the first batch of the seeded order."""
    model, base, merged, _, batches = lm
    loaded = copy.deepcopy(model)
    loaded.load_state_dict(merged)
    total = count = 0.0
    first = {}
    with torch.no_grad():
        for k, batch in enumerate(batches):
            p = torch.softmax(loaded(**batch).logits.double(), dim=-1)
            h = -(p * p.log()).sum(-1)
            mask = batch["attention_mask"].double()
            first[k] = float((h * mask).sum() / mask.sum())
            total, count = total + float((h * mask).sum()), count + float(mask.sum())
    with torch.no_grad():
        sums = [entropy_sum(loaded(**batch).logits, batch["attention_mask"]) for batch in batches]
    result = adamerge_coefficients(model, base, merged, batches, steps=1, **QUIET)
    assert result.entropy_start == pytest.approx(total / count, rel=1e-5)  # float32 logits against float64
    assert result.entropy_start == sum(float(s) for s, _ in sums) / sum(float(c) for _, c in sums)  # the same weights
    order = torch.randperm(3, generator=torch.Generator().manual_seed(0)).tolist()  # seed 0's first pass
    assert result.losses[0] == pytest.approx(first[order[0]], rel=1e-5)


def test_entropy_decreases_on_a_tiny_causal_lm(lm):
    model, base, merged, _, batches = lm
    result = adamerge_coefficients(model, base, merged, batches, steps=20, lr=0.05, **QUIET)
    assert len(result.losses) == 20
    assert result.entropy_end < result.entropy_start - 0.05  # 3.3 -> about 3.0 nats
    assert any(abs(c - 1) > 1e-3 for c in result.coefficients.values())
    again = adamerge_coefficients(model, base, merged, batches, steps=20, lr=0.05, **QUIET)
    assert again.coefficients == result.coefficients  # seeded order, deterministic


def test_classification_loss_is_the_mean_entropy_by_hand():
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, vocab_size=64,
        max_position_embeddings=32, num_labels=5, initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    base = {name: value.clone() for name, value in model.state_dict().items()}
    merged = perturbed(base, 1, 0.2, skip="position_ids")
    batch = {"input_ids": torch.randint(0, 64, (6, 9), generator=torch.Generator().manual_seed(2))}
    loaded = copy.deepcopy(model)
    loaded.load_state_dict(merged)
    with torch.no_grad():
        logits = loaded(**batch).logits.double()
    assert logits.shape == (6, 5)
    p = torch.softmax(logits, dim=-1)
    by_hand = float(-(p * p.log()).sum(-1).mean())
    result = adamerge_coefficients(model, base, merged, [batch], steps=2, lr=0.01, **QUIET)
    assert result.entropy_start == pytest.approx(by_hand, rel=1e-5)
    assert result.losses[0] == pytest.approx(by_hand, rel=1e-5)
    assert result.losses[1] != result.losses[0]  # the coefficients moved


def test_entropy_sum_by_hand():
    logits = torch.tensor([[[0.0, 0.0], [0.0, -math.inf]], [[1000.0, 0.0], [0.0, 0.0]]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    total, count = entropy_sum(logits, mask)
    assert count == 3 and float(total.detach()) == pytest.approx(math.log(2))  # log 2 + 0 (a class of p = 0) + ~0
    total.backward()
    assert torch.isfinite(logits.grad).all()
    flat, n = entropy_sum(torch.zeros(4, 3))
    assert n == 4 and float(flat) == pytest.approx(4 * math.log(3))


def test_only_the_coefficients_learn(lm):
    """The module's own parameters stay as they are and get no gradient, the one the merge lacks (its final norm
    here, which the module's own value fills) included; its mode is restored; the inputs are not modified."""
    model, *states, batches = lm

    def without_norm(state: dict) -> dict:
        return {k: v for k, v in state.items() if k != "model.norm.weight"}

    base, merged, experts = without_norm(states[0]), without_norm(states[1]), [without_norm(e) for e in states[2]]
    model.train()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    inputs = [{k: v.clone() for k, v in state.items()} for state in (base, merged, *experts)]
    result = adamerge_coefficients(model, base, merged, batches, experts=experts, steps=3, lr=0.05, **QUIET)
    assert any(any(mu) for mu in result.expert_coefficients.values())
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert model.training  # its mode is restored
    model.eval()
    for given, kept in zip((base, merged, *experts), inputs, strict=True):
        assert all(torch.equal(given[k], kept[k]) for k in kept)


def test_groups_follow_the_layer_index_and_expert_coefficients_start_at_zero(lm):
    names = [
        "model.embed_tokens.weight",
        "model.layers.10.mlp.up_proj.weight",
        "model.layers.2.self_attn.q_proj.weight",
        "model.layers.2.input_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    assert layer_groups(names) == {
        "model.layers.2": ["model.layers.2.self_attn.q_proj.weight", "model.layers.2.input_layernorm.weight"],
        "model.layers.10": ["model.layers.10.mlp.up_proj.weight"],
        OTHER: ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"],
    }
    model, base, merged, experts, batches = lm
    result = adamerge_coefficients(model, base, merged, batches, experts=experts, steps=0, **QUIET)
    assert list(result.groups) == ["model.layers.0", "model.layers.1", OTHER]
    assert result.coefficients == dict.fromkeys(result.groups, 1.0)
    assert result.expert_coefficients == {group: [0.0, 0.0] for group in result.groups}
    grouped = sorted(name for names in result.groups.values() for name in names)
    assert grouped == sorted(name for name in merged if "norm" not in name)  # the merge left the norms alone


def test_state_is_the_formula(lm):
    """W = W_0 + lambda_g (W_merged - W_0) + sum_i mu_g,i (W_i - W_0), checked in float64 for every tensor."""
    model, base, merged, experts, batches = lm
    result = adamerge_coefficients(model, base, merged, batches, experts=experts, steps=3, lr=0.05, **QUIET)
    state = result.state(base, merged, experts)
    for group, names in result.groups.items():
        lam, mu = result.coefficients[group], result.expert_coefficients[group]
        for name in names:
            w_0 = base[name].double()
            expected = w_0 + lam * (merged[name].double() - w_0)
            expected += sum(m * (e[name].double() - w_0) for m, e in zip(mu, experts, strict=True))
            torch.testing.assert_close(state[name].double(), expected, rtol=0, atol=1e-5 * float(w_0.abs().max()))
    with pytest.raises(SpecmergeError, match="per-expert"):
        result.state(base, merged)


def test_tied_weights_follow_their_tensor():
    config = llama_config()
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    base = {name: value.clone() for name, value in model.state_dict().items()}
    assert "lm_head.weight" in base
    merged = perturbed(base, 1, 0.3)
    merged["lm_head.weight"] = merged["model.embed_tokens.weight"]
    batch = {"input_ids": torch.randint(0, 64, (2, 6))}
    result = adamerge_coefficients(model, base, merged, [batch], steps=2, lr=0.05, **QUIET)
    state = result.state(base, merged)
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])


# --- folders and the command line --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """build_family's tiny Llama (a word-level tokenizer added to the base), two experts and their
    task-arithmetic merge; a text file and a token-id file of inputs."""
    root = tmp_path_factory.mktemp("adamerge")
    base, experts = build_family(root, "llama", n_experts=2)
    example.word_tokenizer().save_pretrained(base)
    merged = root / "merged"
    specmerge.merge(base, experts, merged, method="task_arithmetic", progress=False)
    words = example.WORDS
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(words[int(i)] for i in torch.randint(3, len(words), (8,), generator=g)) for _ in range(10)]
    (root / "texts.txt").write_text("\n".join(lines[:5]) + "\n\n" + "\n".join(lines[5:]) + "\n")
    rows = [{"input_ids": torch.randint(0, 64, (int(n),), generator=g).tolist()} for n in (5, 9, 7, 3)]
    (root / "ids.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root, base, experts, merged


def test_folder_function_end_to_end(family, tmp_path):
    root, base, experts, merged = family
    inputs = [base, *experts, merged]
    before = {str(folder): hashes(folder) for folder in inputs}
    out = tmp_path / "adapted"
    report = adamerge(base, merged, out, data=root / "texts.txt", experts=experts, steps=3, lr=0.05, **QUIET)
    assert {str(folder): hashes(folder) for folder in inputs} == before  # inputs untouched
    written = json.loads((out / "adamerge.json").read_text())
    assert written == json.loads(json.dumps(report))
    assert written["inputs"]["merged"] == "../../" + "/".join(merged.parts[-2:])  # relative to the output
    assert written["batches"] == 2 and len(written["losses"]) == 3
    assert {"config.json", "model.safetensors", "tokenizer.json", "adamerge.json"} <= {p.name for p in out.iterdir()}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    weights, w_b = load_file(out / "model.safetensors"), load_file(base / "model.safetensors")
    w_m = load_file(merged / "model.safetensors")
    w_e = [load_file(e / "model.safetensors") for e in experts]
    name = "model.layers.1.mlp.up_proj.weight"
    lam, mu = written["coefficients"]["model.layers.1"], written["expert_coefficients"]["model.layers.1"]
    expected = (
        w_b[name] + lam * (w_m[name] - w_b[name]) + sum(m * (e[name] - w_b[name]) for m, e in zip(mu, w_e, strict=True))
    )
    torch.testing.assert_close(weights[name], expected, rtol=0, atol=1e-6)
    assert torch.equal(loaded.state_dict()[name], weights[name])


def test_command_line_end_to_end(family, tmp_path, capsys):
    root, base, _, merged = family
    out = tmp_path / "cli"
    argv = ["adamerge", str(base), str(merged), "-o", str(out), "--data", str(root / "ids.jsonl"), "--steps", "2"]
    assert main([*argv, "-q", "--batch-size", "2"]) == 0
    assert "adamerge: mean entropy" in capsys.readouterr().out
    report = json.loads((out / "adamerge.json").read_text())
    assert report["settings"]["batch_size"] == 2 and report["batches"] == 2 and report["settings"]["device"] == "cpu"
    if not torch.cuda.is_available():  # auto is this CPU: the same run, the same bits
        assert main([*argv, "-q", "--batch-size", "2", "--device", "auto", "-o", str(tmp_path / "auto")]) == 0
        assert hashes(tmp_path / "auto") | {"adamerge.json": ""} == hashes(out) | {"adamerge.json": ""}
    assert main([*argv, "-q"]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and err.count("\n") == 1
    assert main([*argv, "-q", "--overwrite", "--steps", "0"]) == 0
    state, merged_state = load_file(out / "model.safetensors"), load_file(merged / "model.safetensors")
    assert all(torch.equal(state[k], merged_state[k]) for k in merged_state)  # 0 steps: the merge, bit for bit


def test_nothing_is_left_behind_on_error(family, tmp_path, monkeypatch):
    root, base, _, merged = family
    out = tmp_path / "new" / "adapted"

    def broken(*args):
        raise OSError("disk gone")

    monkeypatch.setattr(adamerge_io, "copy_tokenizer_files", broken)  # fails after the weights are written
    with pytest.raises(OSError):
        adamerge(base, merged, out, data=root / "ids.jsonl", steps=1, **QUIET)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SpecmergeError, match="overlaps the input"):
        adamerge(base, merged, merged / "inside", data=root / "ids.jsonl", steps=1, **QUIET)


# --- one-line errors ---------------------------------------------------------------------------------------------


def test_bad_data_and_settings_are_one_line(family, tmp_path, capsys):
    root, base, _, merged = family
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "bad.jsonl").write_text('{"text": "w1"}\n{"label": 3}\n')
    cases = {
        "does not exist": ["--data", str(tmp_path / "missing.txt")],
        "holds no input": ["--data", str(tmp_path / "blank.txt")],
        "line 2": ["--data", str(tmp_path / "bad.jsonl")],
        "steps must be": ["--steps", "-1"],
        "lr must be": ["--lr", "0"],
        "batch_size must be": ["--batch-size", "0"],
        "device 'gpu' is not one of": ["--device", "gpu"],
    }
    if not torch.cuda.is_available():
        cases["no CUDA device"] = ["--device", "cuda"]
    for expected, typed in cases.items():
        argv = ["adamerge", str(base), str(merged), "-o", str(tmp_path / "out"), "--data", str(root / "ids.jsonl")]
        assert main([*argv, *typed, "-q"]) == 2, expected
        err = capsys.readouterr().err
        assert err.startswith("specmerge: error: ") and expected in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_mismatched_folders_are_refused(family, tmp_path):
    root, base, experts, merged = family
    other = tmp_path / "wider"
    transformers.LlamaForCausalLM(llama_config(hidden=48)).save_pretrained(other)
    data = root / "ids.jsonl"
    with pytest.raises(SpecmergeError, match=r"tensor '.*' is \(.*\) in the merged model but \(.*\) in the base"):
        adamerge(base, other, tmp_path / "a", data=data, **QUIET)
    with pytest.raises(SpecmergeError, match=r"expert 1: tensor '.*' is \(.*\) in the base but the expert has"):
        adamerge(base, merged, tmp_path / "b", data=data, experts=[experts[0], other], **QUIET)
    deeper = tmp_path / "deeper"
    transformers.LlamaForCausalLM(llama_config(layers=3)).save_pretrained(deeper)
    with pytest.raises(SpecmergeError, match="is in the merged model but not in the base"):
        adamerge(base, deeper, tmp_path / "c", data=data, **QUIET)
    with pytest.raises(SpecmergeError, match="initialised it at random"):
        adamerge(base, merged, tmp_path / "d", data=data, task="classification", **QUIET)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deeper", "wider"]


def test_bad_logits_and_non_finite_losses_stop_with_one_line(lm):
    model, base, merged, _, batches = lm
    with pytest.raises(SpecmergeError, match=r"logits of shape \(4,\)"):
        adamerge_coefficients(model, base, merged, batches, forward=lambda m, b: m(**b).logits[:, 0, 0], **QUIET)

    def diverging(m, b):  # finite while the start is measured, NaN once training
        logits = m(**b).logits
        return logits * math.nan if torch.is_grad_enabled() else logits

    with pytest.raises(SpecmergeError, match=r"became nan at step 0.*lower the learning rate"):
        adamerge_coefficients(model, base, merged, batches, forward=diverging, **QUIET)
    broken = dict(merged, **{"lm_head.weight": merged["lm_head.weight"] * math.inf})
    with pytest.raises(SpecmergeError, match="entropy of the merged model is nan"):
        adamerge_coefficients(model, base, broken, batches, **QUIET)
    with pytest.raises(SpecmergeError, match="no batches"):
        adamerge_coefficients(model, base, merged, [], **QUIET)
