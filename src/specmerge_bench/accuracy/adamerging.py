"""AdaMerging stage of the accuracy benchmark: a merge chosen on val, adapted per layer on the unlabeled test inputs.

Protocol of the rows "SWUDI → AdaMerging" and "SWUDI-A → AdaMerging" (:data:`specmerge_bench.accuracy.rows.
ADAMERGING_ROWS`), as AdaMerging (Yang et al., ICLR 2024) adapts at test time: start from the merge the anchor
row chose on validation (candidate and final scale s), learn one coefficient per encoder layer on that merge's
delta with :func:`specmerge.tuning.adamerge.adamerge_coefficients` (the code ``specmerge adamerge`` runs),
minimising the mean over tasks of the entropy of each task's frozen head on that task's test inputs, then score
the adapted model on test. The stage is given the test inputs only (:func:`specmerge_bench.accuracy.model.
unlabeled_inputs`), never a label.

Defaults (:data:`specmerge_bench.accuracy.rows.ADAMERGING`): Adam with AdaMerging's learning rate 1e-3, 200
steps of 256 inputs (the scoring's batch size) split evenly over the tasks, 32 per task for the 8 tasks
(AdaMerging: 16 per task, 500 steps). The steps are set by the time budget, estimated from the forward cost:
BENCHMARKS.md measures one scoring pass over the 9,600 test inputs at 4.9 s on the 2-core box (0.5 ms per
input, MiniLM under bf16 autocast), and a step (forward and backward through the encoder) costs about 3
forwards of its inputs (2.7-2.8x measured on a MiniLM-sized BERT in float32). So 200 steps x 3 x 256 x 0.5 ms
= 80 s, plus two passes over the test inputs for the mean entropy before and after (5 s each) and the test
scoring (5 s): about 1.6 minutes per row, 3.2 minutes per seed for the two rows.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import Tensor

from specmerge import tuning
from specmerge.tuning.adamerge import adamerge_coefficients
from specmerge_bench.accuracy import model as accuracy_model
from specmerge_bench.accuracy.model import Head, multitask_logits
from specmerge_bench.accuracy.rows import ADAMERGING, AdaMergingSettings
from specmerge_bench.accuracy.scores import files_digest

StateDict = dict[str, Tensor]
Inputs = Mapping[str, Mapping[str, Tensor]]  # task -> {"input_ids", "attention_mask"}


@functools.cache
def code_key() -> str:
    """A hash of the code behind an AdaMerging result (its cached scores are reused only while it is unchanged);
    read once per process, as :func:`specmerge_bench.accuracy.scores.code_key`."""
    folder = Path(tuning.__file__).resolve().parent
    files = [*sorted(folder.glob("adamerge*.py")), Path(__file__).resolve(), Path(accuracy_model.__file__).resolve()]
    return files_digest(files)


def task_batches(inputs: Inputs, batch_size: int, seed: int = 0) -> list[dict[str, dict[str, Tensor]]]:
    """AdaMerging's batches: each holds m = min(batch_size // tasks, the smallest task's size) inputs of every task,
    so that a batch's mean entropy is the mean over tasks of each task's mean entropy.

    Every task's inputs are taken in a random order (``seed``); there are ceil(largest task / m) batches, so every
    input is in one, a smaller task's order starting again from its beginning when it runs out.
    """
    sizes = {task: len(x["input_ids"]) for task, x in inputs.items()}
    per_task = max(1, min(batch_size // len(inputs), *sizes.values()))
    generator = torch.Generator().manual_seed(seed)
    orders = {task: torch.randperm(n, generator=generator) for task, n in sizes.items()}
    batches = []
    for k in range(math.ceil(max(sizes.values()) / per_task)):
        positions = torch.arange(k * per_task, (k + 1) * per_task)
        rows = {task: orders[task][positions % n] for task, n in sizes.items()}
        batches.append({task: {name: x[rows[task]] for name, x in inputs[task].items()} for task in inputs})
    return batches


class AdaMergingStage:
    """AdaMerging for the benchmark's encoder: the scoring model, the frozen heads, the unlabeled inputs' batches."""

    def __init__(
        self,
        model: transformers.BertModel,
        heads: Mapping[str, Head],
        inputs: Inputs,
        settings: AdaMergingSettings = ADAMERGING,
        *,
        autocast: bool | None = None,
    ) -> None:
        self.model, self.heads, self.settings, self.autocast = model, dict(heads), settings, autocast
        self.batches = task_batches(inputs, settings.batch_size, settings.seed)
        self.key = f"adamerging({settings.describe()})-{code_key()}"

    def forward(self, model: transformers.BertModel, batch: Inputs) -> Tensor:
        return multitask_logits(model, batch, self.heads, autocast=self.autocast)

    def adapt(self, base: StateDict, merged: StateDict, *, progress: bool = False) -> tuple[StateDict, dict[str, Any]]:
        """The adapted state dict of the merge ``merged`` of ``base``, and what was learned: the coefficient of each
        layer, the mean entropy over the batches before and after, the seconds it took."""
        start = time.perf_counter()
        s = self.settings
        result = adamerge_coefficients(self.model, base, merged, self.batches, forward=self.forward, steps=s.steps,
                                       lr=s.lr, seed=s.seed, progress=progress)  # fmt: skip
        record = {"coefficients": result.coefficients, "entropy_start": result.entropy_start,
                  "entropy_end": result.entropy_end, "seconds": time.perf_counter() - start}  # fmt: skip
        return result.state(base, merged), record
