"""The accuracy benchmark's AdaMerging rows: the multi-task entropy, the batches, and an end-to-end run on a tiny BERT
whose test labels raise if read while AdaMerging runs."""

import json
import math
import shutil

import pytest
import torch
import transformers

from specmerge.tuning.adamerge import entropy_sum
from specmerge_bench.accuracy import adamerging, bench, cache_files, rows
from specmerge_bench.accuracy import model as accuracy_model
from specmerge_bench.accuracy.model import Head, multitask_logits
from test_accuracy_model import tiny_model_dir, world  # noqa: F401  (fixtures)


def test_padded_multitask_logits_give_the_sum_of_each_tasks_entropy():
    """Heads with 3 and 2 classes: the stacked logits (the 2-class task padded with -inf) have the entropies of each
    head alone, so a batch with m inputs per task has mean entropy = mean over tasks of each task's mean."""
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
                                     vocab_size=20, max_position_embeddings=16)  # fmt: skip
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    heads = {"a": Head(torch.randn(3, 8), torch.randn(3), 0.0), "b": Head(torch.randn(2, 8), torch.randn(2), 0.0)}
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    batch = {task: {"input_ids": torch.randint(0, 20, (3, 4)), "attention_mask": mask} for task in heads}
    logits = multitask_logits(model, batch, heads, autocast=False)
    assert logits.shape == (6, 3) and torch.isinf(logits[3:, 2]).all() and torch.isfinite(logits[:, :2]).all()
    total, count = entropy_sum(logits)
    alone = [entropy_sum(multitask_logits(model, {t: batch[t]}, heads, autocast=False)) for t in heads]
    torch.testing.assert_close(total, alone[0][0] + alone[1][0])
    assert count == 6 and all(c == 3 for _, c in alone)
    total.backward()  # the -inf padding adds no NaN to the gradient
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_batches_hold_the_same_number_of_inputs_of_every_task_and_cover_them_all():
    inputs = {
        "big": {"input_ids": torch.arange(7).unsqueeze(1), "attention_mask": torch.ones(7, 1, dtype=torch.long)},
        "small": {"input_ids": torch.arange(3).unsqueeze(1), "attention_mask": torch.ones(3, 1, dtype=torch.long)},
    }
    batches = adamerging.task_batches(inputs, batch_size=8, seed=1)
    assert len(batches) == 3  # m = min(8 // 2, 3) = 3 per task; ceil(7 / 3) batches
    for batch in batches:
        assert list(batch) == ["big", "small"]
        assert all(set(x) == {"input_ids", "attention_mask"} and len(x["input_ids"]) == 3 for x in batch.values())
    big = torch.cat([b["big"]["input_ids"] for b in batches]).flatten().tolist()
    small = torch.cat([b["small"]["input_ids"] for b in batches]).flatten().tolist()
    assert sorted(set(big)) == list(range(7)) and len(big) == 9  # two wrap around to the start of the order
    assert small == small[:3] * 3 and sorted(small[:3]) == [0, 1, 2]  # the small task cycles through its order
    again = adamerging.task_batches(inputs, batch_size=8, seed=1)  # the same seed, the same batches
    assert all(torch.equal(x[t][k], y[t][k]) for x, y in zip(batches, again, strict=True) for t in x for k in x[t])


class Guard:
    """While ``active`` (the AdaMerging stage runs), reading a test label raises; otherwise reads are counted."""

    active = False
    reads = 0

    @classmethod
    def read(cls, what: str) -> None:
        if cls.active:
            raise AssertionError(f"a test label was read during AdaMerging ({what})")
        cls.reads += 1


class GuardedLabels(torch.Tensor):
    """Labels that report every torch operation on them (a label tensor taken out before the stage and used in it)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        Guard.read(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


class GuardedSplit:
    """A test split whose ``labels`` attribute reports every access."""

    def __init__(self, split: accuracy_model.EncodedSplit) -> None:
        self.input_ids, self.attention_mask = split.input_ids, split.attention_mask
        self.guarded = split.labels.as_subclass(GuardedLabels)

    @property
    def labels(self) -> torch.Tensor:
        Guard.read("the labels attribute")
        return self.guarded

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}

    def __len__(self) -> int:
        return len(self.labels)


def guarded(function):
    """``function``, run with the guard on."""

    def run(*args, **kwargs):
        Guard.active = True
        try:
            return function(*args, **kwargs)
        finally:
            Guard.active = False

    return run


def guard_test_labels(monkeypatch) -> None:
    """Scoring loads every test split with guarded labels (``GuardedSplit``)."""
    load_encoded = cache_files.load_encoded

    def load_guarded(path):
        encoded = load_encoded(path)
        return {task: {**splits, "test": GuardedSplit(splits["test"])} for task, splits in encoded.items()}

    monkeypatch.setattr(cache_files, "load_encoded", load_guarded)


@pytest.mark.parametrize("track", ["full", "lora"])
def test_selection_on_val_never_reads_a_test_label(world, tiny_model_dir, monkeypatch, track):  # noqa: F811
    """Every choice of a row (candidate and scale, best mean val accuracy) is made with the test labels guarded;
    only the chosen setting's test scoring reads them."""
    small = rows.method_rows(grids={"swudi": {"rank_ratio": (0.5,), "t": (300.0, 1300.0)}})
    monkeypatch.setattr(bench, "method_rows", lambda: [r for r in small if r.label in ("tsv_m", "swudi", "ties")])
    monkeypatch.setattr(rows, "WUDI_STEPS", (2,))
    monkeypatch.setattr(bench, "SCALES", (0.3, 1.0))
    guard_test_labels(monkeypatch)
    chosen = []
    best = guarded(bench.best_on_val)
    monkeypatch.setattr(bench, "best_on_val", lambda *a, **k: chosen.append(1) or best(*a, **k))
    run = {"model_dir": tiny_model_dir, "manifest": world["manifest"], "steps": 5, "progress": False}
    Guard.reads = 0
    summary, _ = bench.run_benchmark(world["cache"], (0,), adamerging=None, log=lambda line: None, track=track, **run)
    assert chosen and Guard.reads > 0  # choices were made guarded; the chosen settings' test scoring read labels
    assert {"tsv_m", "swudi", "ties"} <= set(summary["rows"])


def test_adamerging_rows_never_read_a_test_label(world, tiny_model_dir, monkeypatch):  # noqa: F811
    small = rows.method_rows(grids={"swudi": {"rank_ratio": (0.5,), "t": (300.0, 1300.0)}})
    monkeypatch.setattr(bench, "method_rows", lambda: [r for r in small if r.label in ("swudi", "swudi_a_psqrt")])
    monkeypatch.setattr(rows, "WUDI_STEPS", (2,))
    monkeypatch.setattr(bench, "SCALES", (0.3, 1.0))
    guard_test_labels(monkeypatch)
    # the guard is on from the moment the stage gets its inputs until it returns the adapted model
    monkeypatch.setattr(accuracy_model, "unlabeled_inputs", guarded(accuracy_model.unlabeled_inputs))
    monkeypatch.setattr(adamerging.AdaMergingStage, "__init__", guarded(adamerging.AdaMergingStage.__init__))
    adapted = []
    adapt = guarded(adamerging.AdaMergingStage.adapt)
    monkeypatch.setattr(adamerging.AdaMergingStage, "adapt", lambda *a, **k: adapted.append(1) or adapt(*a, **k))
    run = {"model_dir": tiny_model_dir, "manifest": world["manifest"], "steps": 5, "progress": False}
    Guard.reads = 0
    summary, folder = bench.run_benchmark(
        world["cache"], (0,), adamerging=rows.AdaMergingSettings(steps=3), log=lambda line: None, **run
    )
    assert len(adapted) == 2 and Guard.reads > 0  # both rows adapted; the guard saw the scoring read labels
    assert list(summary["rows"])[:4] == ["swudi", "swudi_adamerging", "swudi_a_psqrt", "swudi_a_psqrt_adamerging"]
    table = (folder / "results.md").read_text()
    per_seed = json.loads((folder / "results.json").read_text())["per_seed"][0]["rows"]
    for ada in rows.ADAMERGING_ROWS:
        row, anchor = summary["rows"][ada.label], summary["rows"][ada.anchor]
        assert row["anchor"] == ada.anchor and table.count(f"| {ada.title} |") == 2  # main and AdaMerging tables
        change = row["average"]["mean"] - anchor["average"]["mean"]
        assert row["change"]["mean"] == pytest.approx(change, abs=1e-12)
        assert all(math.isfinite(v) for v in (row["average"]["mean"], row["entropy"]["start"]["mean"],
                                              row["entropy"]["end"]["mean"]))  # fmt: skip
        coefficients = per_seed[ada.label]["coefficients"]
        assert len(coefficients) == 2 and all(math.isfinite(c) and c != 1.0 for c in coefficients.values())
        assert per_seed[ada.label]["scale"] == per_seed[ada.anchor]["scale"]
        assert per_seed[ada.anchor]["choice"] in per_seed[ada.label]["choice"]

    # 0 steps is the merge itself: the same test accuracies, a change of exactly 0; a new setting is a new cache
    # key, so only the anchors' chosen merges are made again (the merges kept on disk removed first), and only the
    # two adapted models are scored
    merged, scored = [], []
    merge, evaluate = bench.merge_candidates, accuracy_model.evaluate
    monkeypatch.setattr(bench, "merge_candidates", lambda b, e, c, **k: merged.append(c) or merge(b, e, c, **k))
    monkeypatch.setattr(accuracy_model, "evaluate", lambda *a, **k: scored.append(a[3]) or evaluate(*a, **k))
    shutil.rmtree(world["cache"] / "merges")
    again, _ = bench.run_benchmark(
        world["cache"], (0,), adamerging=rows.AdaMergingSettings(steps=0), log=lambda line: None, **run
    )
    assert [sorted(c.describe() for c in candidates) for candidates in merged] == [
        sorted(per_seed[ada.anchor]["choice"] for ada in rows.ADAMERGING_ROWS)
    ]
    assert scored == ["test", "test"]
    for ada in rows.ADAMERGING_ROWS:
        assert again["rows"][ada.label]["per_task"] == again["rows"][ada.anchor]["per_task"]
        assert again["rows"][ada.label]["change"] == {"mean": 0.0, "std": 0.0}
