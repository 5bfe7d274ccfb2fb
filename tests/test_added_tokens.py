"""Experts with added tokens: embedding and head rows matched by token string, and the tokenizer written with them.

The set (tests/token_models.py, the README's examples/added_tokens.py): a tiny Llama base with a 64-token
word-level tokenizer; expert ``tool`` adds ``<tool>`` (64) and ``<think>`` (65), ``math`` adds ``<think>`` (64)
and ``<math>`` (65), ``chat`` adds none. Every expected row is computed here by hand from the saved tensors and
tokenizers: a token the base has gets W_0 + mean_i(W_i - W_0) (a zero task vector where an expert lacks it), a
token the base lacks the mean of the rows of the experts that have it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from specmerge.cli import main
from specmerge.errors import RecipeError, SpecmergeError
from specmerge.io.formats.protocol import TensorInfo
from specmerge.io.formats.sources import open_source
from specmerge.io.output.model_files import config_files, copy_config_files, tokenizer_files, write_output_config
from specmerge.io.views.vocab import align_vocabulary, vocabulary_tensors
from specmerge.io.views.vocab_views import runs
from specmerge.pipeline.recipe.model import Recipe
from specmerge.pipeline.run.api import merge
from token_models import ADDED, KEYS, build, padded_family, vocabulary, weights

EPS = torch.finfo(torch.float32).eps
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
TEXT = "w1 <tool> w2 <think> <math> w3"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return build(tmp_path_factory.mktemp("tokens"))


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return build(tmp_path_factory.mktemp("tied"), tie=True)


def run(base: Path, experts: list[Path], out: Path, **options) -> dict:
    return merge(base, experts, out, expert_keys=KEYS[: len(experts)], progress=False, **options)


def expected_rows(
    name: str, out_vocab: dict[str, int], rows: int, base: Path, experts: list[Path], keep_base: bool = False
) -> torch.Tensor:
    """The rule's value of every output row of tensor ``name``, by hand (see the module docstring)."""
    w0, v0 = weights(base)[name].float(), vocabulary(base)
    held = [(weights(e)[name].float(), vocabulary(e)) for e in experts]
    expected = torch.full((rows, w0.shape[1]), float("nan"))
    for token, row in out_vocab.items():
        if token in v0:
            base_row = w0[v0[token]]
            taus = [w[v[token]] - base_row if token in v else torch.zeros_like(base_row) for w, v in held]
            expected[row] = base_row if keep_base else base_row + sum(taus) / len(taus)
        else:
            expected[row] = torch.stack([w[v[token]] for w, v in held if token in v]).mean(dim=0)
    return expected


def tolerance(*tensors: torch.Tensor, n: int = 3) -> float:
    """float32 rounding of W_0 + mean of n task vectors: a few eps of the largest magnitude per operation."""
    return (n + 2) * EPS * max(float(t.abs().max()) for t in tensors)


def assert_rows(merged: torch.Tensor, expected: torch.Tensor, n: int = 3) -> None:
    assert merged.shape == expected.shape and not expected.isnan().any()
    torch.testing.assert_close(merged, expected, rtol=0, atol=tolerance(merged, expected, n=n))


def test_union_merge_matches_the_rule_for_every_token_and_writes_the_tokenizer(family, tmp_path):
    base, experts = family
    out = tmp_path / "merged"
    report = run(base, experts, out)

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    out_vocab = tokenizer.get_vocab()
    assert len(out_vocab) == 67
    added = {"<tool>": 64, "<think>": 65, "<math>": 66}  # the base's 64 tokens, then tool's, then math's new one
    assert {t: out_vocab[t] for t in added} == added
    assert tokenizer(TEXT, add_special_tokens=False).input_ids == [4, 64, 5, 65, 66, 6]
    assert all(tokenizer.added_tokens_decoder[i].special for i in added.values())  # flags kept

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.vocab_size == 67
    for name, merged in ((EMBED, model.model.embed_tokens.weight), (HEAD, model.lm_head.weight)):
        assert_rows(merged.detach(), expected_rows(name, out_vocab, 67, base, experts))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokenizer(TEXT).input_ids])).logits
    assert logits.shape[-1] == 67 and torch.isfinite(logits).all()

    notes = report["vocabulary"]
    assert notes["tokenizer_source"] == "union" and (notes["base_rows"], notes["output_rows"]) == (64, 67)
    assert notes["added"] == [
        {"token": "<tool>", "id": 64, "from": {"tool": 64}, "special": True},
        {"token": "<think>", "id": 65, "from": {"tool": 65, "math": 64}, "special": True},
        {"token": "<math>", "id": 66, "from": {"math": 65}, "special": True},
    ]
    assert notes["dropped"] == []
    # the same rows mean other tokens in tool and math: listed, and each token kept at its own output row
    assert notes["clashes"] == [
        {"row": 64, "tokens": {"tool": "<tool>", "math": "<think>"}},
        {"row": 65, "tokens": {"tool": "<think>", "math": "<math>"}},
    ]
    assert notes["experts"]["chat"] == {
        "rows": 64, "tokenizer": "own", "lacks_base_tokens": 0, "moved_base_tokens": 0, "renamed": []
    }  # fmt: skip
    assert json.loads((out / "report.json").read_text())["vocabulary"] == notes
    assert "local_files_only" not in json.loads((out / "tokenizer_config.json").read_text())


def test_tied_embeddings(tied, tmp_path):
    base, experts = tied
    assert HEAD not in weights(base)  # a tied checkpoint stores the embedding once
    report = run(base, experts, tmp_path / "merged")
    assert report["vocabulary"]["tensors"] == [EMBED]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert model.config.tie_word_embeddings and model.config.vocab_size == 67
    out_vocab = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged").get_vocab()
    expected = expected_rows(EMBED, out_vocab, 67, base, experts)
    assert_rows(model.model.embed_tokens.weight.detach(), expected)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_tokenizer_source_base_drops_the_added_tokens(family, tmp_path):
    base, experts = family
    out = tmp_path / "merged"
    report = run(base, experts, out, tokenizer_source="base")
    for name in tokenizer_files(base):
        assert (out / name).read_bytes() == (base / name).read_bytes(), name
    merged = weights(out)
    for name in (EMBED, HEAD):
        assert_rows(merged[name], expected_rows(name, vocabulary(base), 64, base, experts))
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 64
    notes = report["vocabulary"]
    assert (notes["output_rows"], notes["added"]) == (64, [])
    assert notes["dropped"] == [
        {"token": "<math>", "from": {"math": 65}},
        {"token": "<think>", "from": {"tool": 65, "math": 64}},
        {"token": "<tool>", "from": {"tool": 64}},
    ]


def test_tokenizer_source_an_expert_takes_its_tokenizer_and_rows(family, tmp_path):
    base, experts = family
    out = tmp_path / "merged"
    report = run(base, experts, out, tokenizer_source="tool")
    tool = experts[0]
    for name in tokenizer_files(tool):
        assert (out / name).read_bytes() == (tool / name).read_bytes(), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer(TEXT, add_special_tokens=False).input_ids == [4, 64, 5, 65, 0, 6]  # <math> is unknown here
    merged = weights(out)
    for name in (EMBED, HEAD):  # <think> is still the mean of tool's row 65 and math's row 64
        assert_rows(merged[name], expected_rows(name, vocabulary(tool), 66, base, experts))
    assert report["vocabulary"]["dropped"] == [{"token": "<math>", "from": {"math": 65}}]
    assert transformers.AutoConfig.from_pretrained(out).vocab_size == 66
    # the same by path, and from the command line
    again = tmp_path / "again"
    argv = ["merge", str(base), *map(str, experts), "-o", str(again), "-q", "--tokenizer-source", str(tool)]
    assert main([*argv, *[f"--expert-key={k}" for k in KEYS]]) == 0
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert "tokenizer_source: tool\n" in (again / "recipe.yaml").read_text()  # the key, never the local path


def test_keep_base_keeps_the_base_rows_and_averages_the_added_ones(family, tmp_path):
    base, experts = family
    overrides = [{"pattern": "*embed_tokens*", "action": "keep_base"}, {"pattern": "lm_head*", "action": "keep_base"}]
    run(base, experts, tmp_path / "merged", overrides=overrides)
    merged, out_vocab = weights(tmp_path / "merged"), vocabulary(tmp_path / "merged")
    for name in (EMBED, HEAD):
        assert torch.equal(merged[name][:64], weights(base)[name])  # copied, bit for bit
        assert_rows(merged[name], expected_rows(name, out_vocab, 67, base, experts, keep_base=True))
    # with tokenizer_source base that is the base's tensor exactly, and no tokenizer of an expert is needed
    bare = tmp_path / "bare"
    shutil.copytree(experts[0], bare)
    for name in tokenizer_files(bare):
        (bare / name).unlink()
    run(base, [bare, experts[1]], tmp_path / "kept", overrides=overrides, tokenizer_source="base")
    assert torch.equal(weights(tmp_path / "kept")[EMBED], weights(base)[EMBED])


def test_merge_embeddings_runs_the_method_on_the_matched_rows(family, tmp_path):
    base, experts = family
    report = run(base, experts, tmp_path / "merged", method="task_arithmetic", merge_embeddings=True)
    merged, out_vocab = weights(tmp_path / "merged"), vocabulary(tmp_path / "merged")
    scale = report["params"]["scale"]
    for name in (EMBED, HEAD):  # W_0 + s * sum tau: 3 * s times the averaged rows' deltas
        averaged = expected_rows(name, out_vocab, 67, base, experts)
        start = torch.cat([weights(base)[name], averaged[64:]])  # the base view: added rows are the holders' mean
        expected = start + 3 * scale * (averaged - start)
        torch.testing.assert_close(merged[name], expected, rtol=0, atol=tolerance(expected, n=6))


def test_no_added_tokens_changes_nothing(family, tmp_path):
    base, experts = family
    chat = experts[2]  # the chat expert adds no token: nothing to match, nothing read
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(chat / "model.safetensors", bare / "model.safetensors")
    shutil.copy(chat / "config.json", bare / "config.json")
    one = run(base, [chat], tmp_path / "one")
    two = run(base, [bare], tmp_path / "two")
    assert "vocabulary" not in one and "vocabulary" not in two
    assert (tmp_path / "one" / "model.safetensors").read_bytes() == (
        tmp_path / "two" / "model.safetensors"
    ).read_bytes()
    for name in tokenizer_files(base):
        assert (tmp_path / "one" / name).read_bytes() == (base / name).read_bytes(), name
    assert (tmp_path / "one" / "config.json").read_bytes() == (tmp_path / "two" / "config.json").read_bytes()


def test_bad_inputs_one_line_each(family, tmp_path, capsys):
    base, experts = family
    tool, math = experts[0], experts[1]

    def copy(source: Path, name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(source, target)
        return target

    def refused(expert: Path, pattern: str, **options) -> str:
        out = tmp_path / f"out-{expert.name}"
        with pytest.raises(SpecmergeError, match=pattern) as err:
            merge(base, [expert, math], out, progress=False, **options)
        assert "\n" not in str(err.value) and not out.exists()
        return str(err.value)

    no_tokenizer = copy(tool, "no-tokenizer")
    for name in tokenizer_files(no_tokenizer):
        (no_tokenizer / name).unlink()
    refused(no_tokenizer, r"expert 'no-tokenizer' has 66 rows in '.*' but the base 64, and no tokenizer files")

    broken = copy(tool, "broken")
    (broken / "tokenizer.json").write_text("{not json")
    refused(broken, r"expert 'broken': transformers cannot read the tokenizer in .*broken")

    secret = tmp_path / "secret.json"
    secret.write_text((tool / "tokenizer.json").read_text())
    linked = copy(tool, "linked")
    (linked / "tokenizer.json").unlink()
    (linked / "tokenizer.json").symlink_to(secret)
    refused(linked, r"tokenizer\.json is a symbolic link to .*secret\.json.*outside")

    unfit = copy(experts[2], "unfit")  # a token added to the tokenizer, the embeddings not resized
    tokenizer = transformers.AutoTokenizer.from_pretrained(unfit)
    tokenizer.add_tokens(["<late>"])
    tokenizer.save_pretrained(unfit)
    refused(unfit, r"expert 'unfit': its tokenizer has token '<late>' at id 64 but '.*' has only 64 rows")

    other = copy(tool, "other")  # another word list: not the base's tokenizer with tokens added
    data = json.loads((other / "tokenizer.json").read_text())
    data["model"]["vocab"] = {(w if w.startswith("<") else w.upper()): i for w, i in data["model"]["vocab"].items()}
    (other / "tokenizer.json").write_text(json.dumps(data))
    refused(other, r"expert 'other': its tokenizer lacks 61 of the base's 64 tokens")

    with pytest.raises(RecipeError, match=r"unknown tokenizer_source 'tol': did you mean 'tool'\?"):
        Recipe(base=str(base), experts=[str(tool)], tokenizer_source="tol")
    assert main(["merge", str(base), str(no_tokenizer), "-o", str(tmp_path / "cli"), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specmerge: error: expert 'no-tokenizer' has 66 rows") and "\n" not in err


def test_lora_experts_keep_the_base_vocabulary(family, tmp_path):
    pytest.importorskip("peft")
    from tiny_models import save_adapter

    base, experts = family
    adapter = save_adapter(base, tmp_path / "lora", seed=3, r=2, target_modules=["q_proj"])
    report = merge(base, [experts[0], adapter], tmp_path / "merged", progress=False, expert_keys=["tool", "lora"])
    assert report["vocabulary"]["experts"]["lora"]["tokenizer"] == "the base's (a LoRA adapter)"
    merged, out_vocab = weights(tmp_path / "merged"), vocabulary(tmp_path / "merged")
    assert merged[EMBED].shape == (66, 32)
    w0, tool = weights(base)[EMBED], weights(experts[0])[EMBED]
    assert_rows(merged[EMBED][64:], tool[64:], n=2)  # only tool has <tool> and <think>
    assert_rows(merged[EMBED][:64], w0 + (tool[:64] - w0) / 2, n=2)  # the adapter's delta there is zero
    assert out_vocab["<think>"] == 65
    with pytest.raises(SpecmergeError, match=r"expert 'lora' is a LoRA adapter that is the tokenizer_source"):
        merge(base, [experts[0], adapter], tmp_path / "x", progress=False, expert_keys=["tool", "lora"],
              tokenizer_source="lora")  # fmt: skip


class CountingSource:
    """A source that records every block of rows read."""

    def __init__(self, source):
        self.source, self.path, self.reads = source, source.path, []

    def infos(self):
        return self.source.infos()

    def load(self, name, rows=None):
        self.reads.append((name, rows))
        return self.source.load(name, rows)

    def describe(self):
        return self.source.describe()

    def files(self):
        return self.source.files()

    def close(self):
        self.source.close()


def test_views_read_row_blocks_as_runs_never_whole_tensors(family):
    from specmerge.io.views.experts import CheckpointExpert

    base, experts = family
    with open_source(base) as b, open_source(experts[0]) as t, open_source(experts[1]) as m:
        counted = [CountingSource(s) for s in (b, t, m)]
        view, views = align_vocabulary(
            counted[0],
            [CheckpointExpert(s) for s in counted[1:]],
            base_path=base,
            expert_paths=experts[:2],
            keys=KEYS[:2],
        )[:2]
        whole = {"base": view.load(EMBED), "tool": views[0].read(EMBED).weight, "math": views[1].read(EMBED).weight}
        for source in counted:
            source.reads.clear()
        blocks = [(0, 30), (30, 64), (64, 66), (66, 67)]
        for name, read in (("base", view.load), ("tool", lambda n, r: views[0].read(n, r).weight)):
            assert torch.equal(torch.cat([read(EMBED, r) for r in blocks]), whole[name])
        assert all(rows is not None for source in counted for _, rows in source.reads)
        assert ("model.embed_tokens.weight", (64, 66)) in counted[1].reads  # tool's two added rows at once
        assert views[1].infos()[EMBED].shape == (67, 32)


def test_runs():
    index = torch.tensor([5, 6, 7, -1, 0, 1, 9, -1, -1, 3])
    assert runs(index) == [(0, 3, 5), (4, 6, 0), (6, 7, 9), (9, 10, 3)]
    assert runs(torch.tensor([-1, -1])) == [] and runs(torch.tensor([], dtype=torch.int64)) == []


def test_vocabulary_tensors_by_name():
    def info(name, shape):
        return TensorInfo(name, shape, torch.float32)

    infos = {
        "transformer.wte.weight": info("transformer.wte.weight", (50, 8)),
        "transformer.wpe.weight": info("transformer.wpe.weight", (16, 8)),  # positions: not a vocabulary
        "lm_head.weight": info("lm_head.weight", (50, 8)),
        "cls.predictions.bias": info("cls.predictions.bias", (50,)),
        "model.shared.weight": info("model.shared.weight", (50, 8)),
    }
    assert vocabulary_tensors(infos) == (
        ["transformer.wte.weight", "lm_head.weight", "cls.predictions.bias", "model.shared.weight"],
        50,
    )
    assert vocabulary_tensors({"x.weight": info("x.weight", (4, 4))}) == ([], None)


def test_config_and_tokenizer_files_are_split(tmp_path):
    names = [
        "added_tokens.json", "chat_template.jinja", "config.json", "configuration_custom.py", "generation_config.json",
        "merges.txt", "preprocessor_config.json", "qwen.tiktoken", "sentencepiece.bpe.model", "special_tokens_map.json",
        "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "model.safetensors", "README.md",
    ]  # fmt: skip
    for name in names:
        (tmp_path / name).write_text(name)
    assert list(config_files(tmp_path)) == [
        "config.json", "configuration_custom.py", "generation_config.json", "preprocessor_config.json"
    ]  # fmt: skip
    assert list(tokenizer_files(tmp_path)) == [
        "added_tokens.json", "chat_template.jinja", "merges.txt", "qwen.tiktoken", "sentencepiece.bpe.model",
        "special_tokens_map.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json",
    ]  # fmt: skip
    (tmp_path / "out").mkdir()
    assert copy_config_files(tmp_path, tmp_path / "out") == list(config_files(tmp_path))
    assert sorted(os.listdir(tmp_path / "out")) == list(config_files(tmp_path))


def test_config_states_the_vocabulary_rows(tmp_path):
    weights_written = [TensorInfo("w", (4, 4), torch.float32)]
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 64, "text_config": {"vocab_size": 64}}))
    write_output_config(tmp_path, weights_written, vocab_size=67)
    assert json.loads((tmp_path / "config.json").read_text()) == {
        "vocab_size": 67, "text_config": {"vocab_size": 67}, "torch_dtype": "float32"
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 64}}))
    write_output_config(tmp_path, weights_written, vocab_size=67)
    assert json.loads((tmp_path / "config.json").read_text())["text_config"] == {"vocab_size": 67}
    assert "vocab_size" not in json.loads((tmp_path / "config.json").read_text())


def test_schema_and_help_offer_tokenizer_source(capsys):
    from specmerge.pipeline.recipe.schema import recipe_schema

    field = recipe_schema()["properties"]["tokenizer_source"]
    assert field["default"] == "union" and "union" in field["description"]
    with pytest.raises(SystemExit):
        main(["merge", "--help"])
    assert "--tokenizer-source SOURCE" in capsys.readouterr().out
    assert set(ADDED) == set(KEYS)


def test_a_token_added_in_the_base_padding_rows_is_matched_too(tmp_path):
    base, experts = padded_family(tmp_path)
    report = run(base, experts, tmp_path / "merged")  # no expert has other rows: the tokenizer files tell
    assert report["vocabulary"]["added"] == [{"token": "<tool>", "id": 64, "from": {"tool": 64}, "special": True}]
    merged, out_vocab = weights(tmp_path / "merged"), vocabulary(tmp_path / "merged")
    assert out_vocab["<tool>"] == 64 and len(out_vocab) == 65
    for name in (EMBED, HEAD):
        w0, taus = weights(base)[name], [weights(e)[name] - weights(base)[name] for e in experts]
        expected = expected_rows(name, out_vocab, 65, base, experts)  # the tokens' rows
        padding = w0[65:] + sum(t[65:] for t in taus) / 2  # the padding rows stay by index
        assert_rows(merged[name], torch.cat([expected, padding]), n=2)
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["vocab_size"] == 72


def test_a_renamed_token_is_reported_and_matched_by_its_new_string(family, tmp_path):
    base, experts = family
    renamed = tmp_path / "tool"  # tool's tokenizer calls id 63 '<reserved>' (a special token) instead of 'w60'
    shutil.copytree(experts[0], renamed)
    data = json.loads((renamed / "tokenizer.json").read_text())
    del data["model"]["vocab"]["w60"]
    data["model"]["vocab"]["<reserved>"] = 63
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    data["added_tokens"] = sorted(
        [*data["added_tokens"], {"id": 63, "content": "<reserved>", **flags}], key=lambda t: t["id"]
    )
    (renamed / "tokenizer.json").write_text(json.dumps(data))
    report = run(base, [renamed, experts[1]], tmp_path / "merged")
    notes = report["vocabulary"]
    assert notes["experts"]["tool"]["renamed"] == [{"id": 63, "base": "w60", "expert": "<reserved>"}]
    assert notes["experts"]["tool"]["lacks_base_tokens"] == 1
    assert notes["added"][0] == {"token": "<reserved>", "id": 64, "from": {"tool": 63}, "special": True}
    merged, out_vocab = weights(tmp_path / "merged"), vocabulary(tmp_path / "merged")
    assert len(out_vocab) == 68
    for name in (EMBED, HEAD):  # 'w60' keeps the base's row plus math's half delta; '<reserved>' is tool's row
        assert_rows(merged[name], expected_rows(name, out_vocab, 68, base, [renamed, experts[1]]), n=2)


def test_an_expert_in_another_dtype(family, tmp_path):
    base, experts = family
    half = tmp_path / "tool"  # tool saved in bfloat16: its rows where it lacks a token are the base's, in float32
    model = transformers.AutoModelForCausalLM.from_pretrained(experts[0], dtype=torch.bfloat16)
    model.save_pretrained(half)
    transformers.AutoTokenizer.from_pretrained(experts[0]).save_pretrained(half)
    run(base, [half, experts[1]], tmp_path / "merged")
    merged, out_vocab = weights(tmp_path / "merged"), vocabulary(tmp_path / "merged")
    for name in (EMBED, HEAD):
        assert merged[name].dtype == torch.float32
        assert_rows(merged[name], expected_rows(name, out_vocab, 67, base, [half, experts[1]]), n=2)
