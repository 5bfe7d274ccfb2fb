"""Embeddings get the method asked for, unless told otherwise, and the console names every tensor that does not
(issue 51, silent difference 1).

Before, ``embed_tokens`` / ``lm_head`` were averaged whatever the method: with ``-m slerp -p t=0.3`` and one expert
the output's embeddings were the expert's own (t = 1) while the rest was at t = 0.3, and TIES, TA and DARE's lm_head
differed from mergekit's by 54-89 %. Now unset ``merge_embeddings`` is the method's convention (elementwise methods,
slerp and model_stock merge them, as mergekit does; methods of linear layers average them, as their papers do), and
either way a console line says which tensors did not get the method and why.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import specmerge
from specmerge.cli import main
from specmerge.io.output.folder import OUTPUT_LOG

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import build_family

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("emb"), "llama", 2)


def merged(family, out: Path, caplog, experts: int = 2, **options) -> tuple[dict, list[str]]:
    base, all_experts = family
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=OUTPUT_LOG):
        specmerge.merge(base, all_experts[:experts], out, progress=False, **options)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("not merged with")]
    return load_file(out / "model.safetensors"), said


def test_slerp_moves_the_embeddings_with_everything_else(tmp_path, family, caplog):
    base, experts = family
    w0, w1 = load_file(base / "model.safetensors"), load_file(experts[0] / "model.safetensors")
    out, said = merged(family, tmp_path / "slerp", caplog, experts=1, method="slerp", params={"t": 0.3})
    assert said == []  # every tensor got slerp
    for name in (EMBED, HEAD, "model.layers.0.mlp.up_proj.weight"):  # each at t = 0.3: between, not the expert's
        assert not torch.equal(out[name], w1[name]) and not torch.equal(out[name], w0[name]), name
    explicit, _ = merged(family, tmp_path / "slerp-true", caplog, experts=1, method="slerp", params={"t": 0.3},
                         merge_embeddings=True)  # fmt: skip
    assert all(torch.equal(out[n], explicit[n]) for n in out)  # the default is the method asked for
    averaged, said = merged(family, tmp_path / "slerp-false", caplog, experts=1, method="slerp", params={"t": 0.3},
                            merge_embeddings=False)  # fmt: skip
    assert torch.equal(averaged[EMBED], w1[EMBED])  # the mean of one expert: the old, silent result, now asked for
    assert said == [
        f"not merged with slerp: 2 averaged (embedding; merge_embeddings: false; e.g. '{EMBED}')"
    ] or said == [f"not merged with slerp: 2 averaged (embedding; merge_embeddings: false; e.g. '{HEAD}')"]


@pytest.mark.parametrize("method", ["ties", "task_arithmetic", "dare_ties"])
def test_elementwise_methods_merge_the_head_as_every_other_tensor(tmp_path, family, caplog, method):
    out, said = merged(family, tmp_path / method, caplog, method=method)
    explicit, _ = merged(family, tmp_path / f"{method}-true", caplog, method=method, merge_embeddings=True)
    assert said == [] and all(torch.equal(out[n], explicit[n]) for n in out)
    averaged, _ = merged(family, tmp_path / f"{method}-false", caplog, method=method, merge_embeddings=False)
    assert not torch.equal(out[HEAD], averaged[HEAD])


def test_a_method_of_linear_layers_averages_them_and_says_so(tmp_path, family, caplog):
    out, said = merged(family, tmp_path / "swudi_a", caplog, method="swudi_a")
    assert len(said) == 1
    assert "averaged (embedding; a method of linear layers" in said[0] and "norm/bias (1-D)" in said[0]
    assert said[0].endswith("(merge_embeddings: true gives embeddings the method)")
    explicit, said = merged(family, tmp_path / "swudi_a-true", caplog, method="swudi_a", merge_embeddings=True)
    assert not torch.equal(out[HEAD], explicit[HEAD]) and "embedding" not in said[0]


def test_an_in_memory_merge_says_it_too(family, caplog):
    from safetensors.torch import load_file as load

    base, experts = family
    states = [load(folder / "model.safetensors") for folder in (base, *experts)]
    with caplog.at_level(logging.INFO, logger=OUTPUT_LOG):
        specmerge.merge_state_dicts(states[0], states[1:], method="swudi_a")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("not merged with swudi_a")]
    assert len(said) == 1 and "embedding; a method of linear layers" in said[0]


def test_the_command_line_sets_it_either_way(tmp_path, family, capsys):
    base, experts = family
    argv = ["merge", str(base), *map(str, experts), "-m", "ties"]  # not -q: quiet leaves notes out
    assert main([*argv, "-o", str(tmp_path / "off"), "--no-merge-embeddings"]) == 0
    assert "embedding; merge_embeddings: false" in capsys.readouterr().err
    assert main([*argv, "-o", str(tmp_path / "on"), "--merge-embeddings"]) == 0
    assert "not merged" not in capsys.readouterr().err
    on, off = load_file(tmp_path / "on/model.safetensors"), load_file(tmp_path / "off/model.safetensors")
    assert not torch.equal(on[HEAD], off[HEAD])
