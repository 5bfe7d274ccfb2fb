"""The LoRA track's merges: PEFT adapters merged through specmerge's adapter path, the files users merge.

Each candidate of the main table is merged by :func:`specmerge.merge` from the base model's folder and the seed's
adapter folders (``adapter_config.json`` + ``adapter_model.safetensors``, as ``training.train_lora_expert``
saved them) into a temporary model folder, at scale 1: the code a user runs on adapters, the factored route
where the method has one and the dense one elsewhere. Each tensor's route is read from that merge's
``report.json`` and kept with the scores. The merged folder's difference from the base weights is the
candidate's delta, which serves the whole scale grid as in the full track (every method is linear in
``scale``, :mod:`specmerge_bench.accuracy.merging`); the plan's action per tensor (merged, or averaged) is the
report's.

The WUDI step sweep runs on the adapters' dense deltas (each adapter's ``merge_and_unload`` weights minus the
base), one run with snapshots as in the full track: WUDI takes the dense route on adapters (the report says
so, and a test checks the two agree), so the sweep is the same computation at a sixth of the cost.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import peft
import safetensors.torch
import torch
import transformers
from tqdm.auto import tqdm

import specmerge
from specmerge_bench.accuracy.merging import Candidate, MergedDeltas, StateDict, merge_candidates


def dense_expert(base_model: transformers.BertModel, adapter_dir: str | Path) -> StateDict:
    """The state dict of ``base_model`` with the PEFT adapter in ``adapter_dir`` merged in (``merge_and_unload``)."""
    adapted = peft.PeftModel.from_pretrained(copy.deepcopy(base_model), str(adapter_dir))
    return {name: tensor.detach().clone() for name, tensor in adapted.merge_and_unload().state_dict().items()}


def _read_folder(folder: Path) -> StateDict:
    state: StateDict = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(safetensors.torch.load_file(file))
    return state


class AdapterMerger:
    """Merges candidates from adapter folders with :func:`specmerge.merge`; called as ``evaluate_seed``'s ``merge``.

    ``base_dir`` is the base model's folder and ``base`` its state dict (the encoder's names); ``adapters`` the
    seed's adapter folders in task order and ``dense`` their ``merge_and_unload`` state dicts (for the WUDI
    sweep). Merged folders go to a temporary folder under ``work`` (default: the system's), removed after reading.
    """

    def __init__(
        self,
        base_dir: str | Path,
        base: StateDict,
        adapters: Sequence[str | Path],
        dense: Sequence[StateDict],
        work: str | Path | None = None,
    ) -> None:
        self.base_dir, self.base, self.adapters, self.dense = Path(base_dir), base, list(adapters), list(dense)
        self.work = work

    def __call__(self, candidates: Sequence[Candidate], wudi_steps: Sequence[int], progress: bool) -> MergedDeltas:
        deltas = merge_candidates(self.base, self.dense, [], wudi_steps=wudi_steps, progress=False)
        with tempfile.TemporaryDirectory(prefix="specmerge-lora-track-", dir=self.work) as work:
            for candidate in tqdm(candidates, desc="merging adapters", disable=not progress):
                self.merge_one(candidate, Path(work) / candidate.key, deltas)
        return deltas

    def merge_one(self, candidate: Candidate, folder: Path, into: MergedDeltas) -> None:
        """Merge ``candidate`` through the adapter path into ``folder``; record its delta, seconds and routes."""
        report = specmerge.merge(
            self.base_dir, self.adapters, folder, method=candidate.method,
            params={**candidate.params, "scale": 1.0}, progress=False, fsync=False, threads=torch.get_num_threads(),
            merge_embeddings=False,  # the paper's setup, as the full track (merging.py)
        )  # fmt: skip
        merged = _read_folder(folder)
        shutil.rmtree(folder)
        actions = {t["name"]: t["action"] for t in report["tensors"]}
        into.method[candidate.key], into.averaged[candidate.key] = {}, {}
        for name, value in self.base.items():
            if name not in merged or torch.equal(merged[name], value):
                continue
            delta = merged[name].to(torch.float64) - value.to(torch.float64)
            kept = into.averaged if actions.get(name) == "average" else into.method
            kept[candidate.key][name] = delta.to(torch.float32)
        merging = [t for t in report["tensors"] if t["action"] == "merge"]
        into.seconds[candidate.key] = sum(t["seconds"] for t in merging)
        into.routes[candidate.key] = dict(Counter(t["diagnostics"].get("route", "none") for t in merging))
