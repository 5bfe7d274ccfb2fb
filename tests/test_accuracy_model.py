"""Model stage of the accuracy benchmark on a tiny random BERT and two keyword tasks (seconds, no downloads)."""

import copy
import random
from pathlib import Path

import pytest
import safetensors.torch
import tokenizers
import torch
import transformers

import specmerge_bench.accuracy.data as data
import specmerge_bench.accuracy.experts as stages
import specmerge_bench.accuracy.model as am
import specmerge_bench.accuracy.training as training

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
FILLER = ["the", "a", "of", "and", "to", "in", "is", "it", "on", "with", "for", "as", "by", "at"]
KEYWORDS = {  # task -> per class, the words that decide the label
    "colour": [["red", "crimson"], ["green", "olive"], ["blue", "navy"]],
    "shape": [["round", "circle"], ["square", "box"]],
}


def _texts(task: str, n_per_class: int, rng: random.Random) -> list[tuple[str, int]]:
    rows = []
    for label, words in enumerate(KEYWORDS[task]):
        for _ in range(n_per_class):
            text = rng.choices(FILLER, k=rng.randint(2, 6))
            text.insert(rng.randint(0, len(text)), rng.choice(words))
            rows.append((" ".join(text), label))
    rng.shuffle(rows)
    return rows


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random 2-layer BERT (hidden 32) with a word-level vocabulary, saved as a Hugging Face folder."""
    folder = tmp_path_factory.mktemp("tiny-bert")
    vocab = SPECIAL + FILLER + sorted(word for classes in KEYWORDS.values() for words in classes for word in words)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    ids = {token: i for i, token in enumerate(vocab)}
    wordpiece = tokenizers.Tokenizer(tokenizers.models.WordPiece(ids, unk_token="[UNK]"))
    wordpiece.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    wordpiece.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])]
    )
    tokens = {f"{name}_token": f"[{name.upper()}]" for name in ("unk", "pad", "cls", "sep", "mask")}
    transformers.PreTrainedTokenizerFast(tokenizer_object=wordpiece, **tokens).save_pretrained(folder)
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        vocab_size=len(vocab),
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False)
    config.to_json_file(folder / "config.json")
    safetensors.torch.save_file(model.state_dict(), folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    """Cache dir with the two tasks written as ``data.build_tasks`` would, their manifest, and the loaded base."""
    cache = tmp_path_factory.mktemp("cache")
    rng = random.Random(0)
    tasks = {
        name: data.TaskSplits(
            labels=tuple(f"class{i}" for i in range(len(KEYWORDS[name]))),
            train=_texts(name, 40, rng),
            val=_texts(name, 20, rng),
            test=_texts(name, 20, rng),
        )
        for name in KEYWORDS
    }
    manifest = {"tasks_dir": "tasks/synthetic", "tasks": data.write_tasks(tasks, cache / "tasks" / "synthetic")}
    model, tokenizer = am.load_base(tiny_model_dir)
    encoded = {}
    for name, task in tasks.items():
        encoded[name] = {}
        for split in data.SPLITS:
            rows = getattr(task, split)
            inputs = am.encode(tokenizer, [text for text, _ in rows])
            labels = torch.tensor([label for _, label in rows])
            encoded[name][split] = am.EncodedSplit(inputs["input_ids"], inputs["attention_mask"], labels)
    heads = {}
    for name, splits in encoded.items():
        train, val = (am.pooled_features(model, splits[split].inputs) for split in ("train", "val"))
        heads[name] = am.fit_probe(train, splits["train"].labels, val, splits["val"].labels)
    return {"cache": cache, "manifest": manifest, "model": model, "encoded": encoded, "heads": heads}


def test_encode_pads_to_max_length_and_pooling_ignores_padding(world):
    model, splits = world["model"], world["encoded"]["colour"]
    inputs = splits["val"].inputs
    assert inputs["input_ids"].shape == (60, am.MAX_LENGTH) and inputs["input_ids"].dtype == torch.long
    double = copy.deepcopy(model).double()  # float64: the two computations agree to rounding of a few hundred ops
    pooled = am.pooled_features(double, inputs, batch_size=7, autocast=False)
    one = {key: value[:1, : int(inputs["attention_mask"][0].sum())] for key, value in inputs.items()}
    alone = double(**one).last_hidden_state.mean(1)
    torch.testing.assert_close(pooled[:1], alone.detach(), atol=0, rtol=F64_TOL)


# Relative tolerance for float64 comparisons of two orderings of the same few-layer computation: 1,000 x eps
# covers the rounding of sums over at most a few hundred terms, and is far below any real difference.
F64_TOL = 1000 * torch.finfo(torch.float64).eps


def test_packed_forward_equals_the_padded_bert_forward_with_gradients(world):
    """The encoder on real tokens only (``pooled_features``, ``multitask_logits``) is the same function as
    Hugging Face's padded forward followed by mean pooling: values and parameter gradients, in float64."""
    double = copy.deepcopy(world["model"]).double()
    inputs = world["encoded"]["colour"]["train"].inputs
    batch = {key: value[:24] for key, value in inputs.items()}  # rows of different lengths
    assert len(set(batch["attention_mask"].sum(1).tolist())) > 1
    hidden = double(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).double()
    reference = (hidden * mask).sum(1) / mask.sum(1)
    head = world["heads"]["colour"]
    head64 = am.Head(head.weight.double(), head.bias.double(), head.l2)
    reference_logits = head64.logits(reference)
    reference_grads = torch.autograd.grad(reference_logits.square().sum(), list(double.parameters()), allow_unused=True)
    logits = am.multitask_logits(double, {"colour": batch}, {"colour": head64}, autocast=False)
    grads = torch.autograd.grad(logits.square().sum(), list(double.parameters()), allow_unused=True)
    torch.testing.assert_close(logits, reference_logits, atol=0, rtol=F64_TOL)
    # relative to the largest gradient entry: some are exactly zero in exact arithmetic (the key biases, which
    # softmax cancels) and only rounding in either computation
    scale = max(float(want.abs().max()) for want in reference_grads if want is not None)
    for (name, _), got, want in zip(double.named_parameters(), grads, reference_grads, strict=True):
        if want is None:
            assert got is None or not got.any(), name
            continue
        assert float((got - want).abs().max()) <= F64_TOL * scale, name
    pooled = am.pooled_features(double, batch, batch_size=5, autocast=False)
    torch.testing.assert_close(pooled, reference.detach(), atol=0, rtol=F64_TOL)


def test_probe_learns_the_keyword_tasks(world):
    for name, splits in world["encoded"].items():
        val = am.pooled_features(world["model"], splits["val"].inputs)
        assert am.accuracy(world["heads"][name], val, splits["val"].labels) >= 0.9, name


def test_fit_logistic_folds_standardisation_into_the_head():
    """Standardising inside the fit makes the head's logits invariant to an affine change of the features."""
    g = torch.Generator().manual_seed(0)
    features, labels = torch.randn(90, 5, generator=g), torch.arange(90) % 3
    features[:, 0] += labels
    scale, shift = torch.tensor([1000.0, 0.01, 3.0, 1.0, 50.0]), torch.arange(5.0)
    plain = am.fit_logistic(features, labels, l2=1e-2)
    moved = am.fit_logistic(features * scale + shift, labels, l2=1e-2)
    torch.testing.assert_close(moved.logits(features * scale + shift), plain.logits(features), atol=1e-4, rtol=1e-4)


def test_training_changes_only_encoder_linear_layers_and_is_deterministic(world):
    model, splits, head = world["model"], world["encoded"]["shape"], world["heads"]["shape"]
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    first = training.train_expert(model, splits["train"], head, seed=1, steps=4, lr=1e-3, batch_size=8)
    again = training.train_expert(model, splits["train"], head, seed=1, steps=4, lr=1e-3, batch_size=8)
    other = training.train_expert(model, splits["train"], head, seed=2, steps=4, lr=1e-3, batch_size=8)
    linear = set(training.encoder_linear_parameters(model))
    assert len(linear) == 2 * 6 * 2  # 2 layers x 6 linear modules x (weight, bias)
    assert first.keys() == before.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor, again[name]), name
        assert torch.equal(model.state_dict()[name], before[name]), f"base changed: {name}"
        assert torch.equal(tensor, before[name]) != (name in linear), name
    assert any(not torch.equal(first[name], other[name]) for name in linear)


def test_training_lowers_the_frozen_head_loss(world):
    """Through a fixed random head the base features score badly; training the encoder's linear layers fits it."""
    model, train = world["model"], world["encoded"]["colour"]["train"]
    head = am.Head(torch.randn(3, 32, generator=torch.Generator().manual_seed(0)), torch.zeros(3), l2=0.0)
    probe = transformers.BertModel(model.config, add_pooling_layer=False)

    def loss(state):
        am.load_state(probe, state)
        features = am.pooled_features(probe, train.inputs, autocast=False)
        return float(torch.nn.functional.cross_entropy(head.logits(features), train.labels))

    trained = training.train_expert(model, train, head, seed=0, steps=30, lr=1e-3, batch_size=16)
    assert loss(trained) < 0.5 * loss(model.state_dict())


def test_evaluate_a_state_dict_equals_evaluating_the_model(world):
    model, encoded, heads = world["model"], world["encoded"], world["heads"]
    state = training.train_expert(model, encoded["colour"]["train"], heads["colour"], seed=0, steps=3, lr=1e-3)
    expert = transformers.BertModel(model.config, add_pooling_layer=False)
    am.load_state(expert, state)
    scratch = transformers.BertModel(model.config, add_pooling_layer=False)
    for split in ("val", "test"):
        assert am.evaluate(state, encoded, heads, split, scratch=scratch) == am.evaluate(expert, encoded, heads, split)
    with pytest.raises(ValueError, match="scratch"):
        am.evaluate(state, encoded, heads, "val")
    with pytest.raises(ValueError, match="missing"):
        am.load_state(scratch, {name: t for name, t in state.items() if "query" not in name})


def test_build_experts_caches_every_stage(world, tiny_model_dir, monkeypatch):
    kwargs = {"steps": 3, "lr": 1e-3, "batch_size": 8, "model_dir": tiny_model_dir, "manifest": world["manifest"]}
    first = stages.build_experts(world["cache"], seeds=(0,), **kwargs)
    assert first["cached"] == {"tokens": False, "probes": False}
    assert not first["experts"][0]["colour"]["cached"]
    for name in ("colour", "shape"):
        assert first["probes"][name]["val"] >= 0.9
        folder = Path(first["paths"]["experts"][0][name])
        saved = safetensors.torch.load_file(folder / "model.safetensors")
        loaded = transformers.BertModel.from_pretrained(folder, add_pooling_layer=False)
        assert all(torch.equal(loaded.state_dict()[key], value) for key, value in saved.items())

    def refuse(*args, **kwargs):
        raise AssertionError("a cached stage ran again")

    # Each stage reads splits, fits with L-BFGS, trains with AdamW or writes safetensors when it runs.
    monkeypatch.setattr(stages, "read_split", refuse)
    monkeypatch.setattr(torch.optim, "LBFGS", refuse)
    monkeypatch.setattr(torch.optim, "AdamW", refuse)
    monkeypatch.setattr(safetensors.torch, "save_file", refuse)
    again = stages.build_experts(world["cache"], seeds=(0,), **kwargs)
    assert again["cached"] == {"tokens": True, "probes": True}
    assert again["experts"][0]["shape"]["cached"]
    assert again["experts"][0]["shape"]["test"] == first["experts"][0]["shape"]["test"]
    assert again["paths"] == first["paths"]
    # a reader of experts (train_missing=False) gets the cached ones, and an error naming a seed never trained
    assert stages.build_experts(world["cache"], seeds=(0,), train_missing=False, **kwargs)["paths"] == first["paths"]
    with pytest.raises(stages.AccuracyDataError, match=r"seed1/colour is not built \(the full expert of seed 1\)"):
        stages.build_experts(world["cache"], seeds=(1,), train_missing=False, **kwargs)
