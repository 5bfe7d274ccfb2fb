"""Merge-stage of the accuracy benchmark: every candidate merge of one set of experts, computed layer by layer.

A :class:`Candidate` is a registry method with fixed parameters (its ``scale`` left at 1). Merged
models for a final scale s are ``W_0 + s * delta`` on the tensors the method merges and ``W_0 + mean_i
tau_i`` on the ones the plan averages (``scale_non_matrix`` off, as in ``specmerge merge``): every method
in the registry returns ``scale * (its result at scale 1)``, so one delta per candidate serves the whole
scale grid (a test checks the linearity).

Which tensor gets what comes from :func:`specmerge.pipeline.plan.rules.make_plan`, exactly as for a merge from files:
2-D linear weights get the method, embeddings are averaged (``merge_embeddings: false``: the paper's setup, for
every method alike), biases and LayerNorms are averaged for matrix methods and merged by elementwise ones (TA,
TIES, DARE). The per-tensor calls are the registry methods, so the benchmark measures the code users run. Two
savings for sweeps, both exact:

- the spectral methods of one layer share its normal equation and eigendecomposition
  (:func:`specmerge.linalg.solve.shared_decompositions`), so a grid of SWUDI (r, t) settings, SWUDI-A rules,
  D C^+ and the exponential filter costs one eigh per layer;
- WUDI at several step counts is one run of the largest count with snapshots (:func:`wudi_snapshots`),
  equal to separate runs of the registry's ``wudi`` (:mod:`specmerge.methods.wudi`; a test checks it).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from specmerge.io.formats.protocol import TensorInfo
from specmerge.linalg.optimize import descend, quadratic_gradient
from specmerge.linalg.quadratic import initial_point, normal_equation
from specmerge.linalg.solve import shared_decompositions
from specmerge.methods import get_method
from specmerge.pipeline.plan.rules import make_plan
from specmerge.pipeline.recipe.model import Recipe

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Candidate:
    """One merge to evaluate: a registry method with fixed parameters (``scale`` is swept separately)."""

    label: str  # the row it belongs to in the results (e.g. "swudi"); several candidates share a label
    method: str
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        text = json.dumps([self.method, dict(sorted(self.params.items()))], sort_keys=True, default=str)
        return f"{self.method}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.method}({shown})"


@dataclass
class MergedDeltas:
    """Per candidate: the method's delta at scale 1 on each tensor it merges; shared: the averaged tensors' deltas."""

    method: dict[str, StateDict]  # candidate key -> tensor name -> delta (scale 1)
    averaged: dict[str, StateDict]  # candidate key -> tensor name -> mean delta
    seconds: dict[str, float]  # candidate key -> compute time; "wudi_steps" -> the one snapshot run
    routes: dict[str, dict[str, int]] = field(default_factory=dict)  # candidate key -> route -> tensors (files)

    def state(self, base: StateDict, candidate: Candidate, scale: float) -> StateDict:
        """The merged model's state dict for ``candidate`` at final scale ``scale``."""
        merged = dict(base)
        for name, delta in self.averaged[candidate.key].items():
            merged[name] = base[name] + delta
        for name, delta in self.method[candidate.key].items():
            merged[name] = base[name] + scale * delta
        return merged


def changed_tensors(base: StateDict, experts: Sequence[StateDict]) -> list[str]:
    """Floating tensors that differ from the base in at least one expert (the rest merge to the base)."""
    return [
        name
        for name, value in base.items()
        if value.is_floating_point() and any(not torch.equal(e[name], value) for e in experts)
    ]


def _plans(candidates: Sequence[Candidate], base: StateDict) -> dict[str, dict[str, str]]:
    """Per candidate key: tensor name -> 'merge' / 'average' / 'keep_base', from the real merge plan."""
    infos = {name: TensorInfo(name, tuple(t.shape), t.dtype) for name, t in base.items()}
    plans = {}
    for c in candidates:
        recipe = Recipe(base="<memory>", experts=["<memory>"], method=c.method, params=dict(c.params),
                        merge_embeddings=False)  # fmt: skip
        plans[c.key] = {e.name: e.action for e in make_plan(recipe, infos, [infos], ["<memory>"])}
    return plans


def wudi_snapshots(task_vectors: torch.Tensor, steps: Sequence[int], lr: float = 1e-5) -> dict[int, torch.Tensor]:
    """WUDI (Adam, sum start, scale 1) after each of ``steps``: one run of max(steps) with snapshots."""
    eq = normal_equation(task_vectors)
    if eq.n_experts == 0:
        return {s: torch.zeros_like(task_vectors[0]) for s in steps}
    wanted, out = set(steps), {}

    def keep(step: int, tau: torch.Tensor) -> None:
        if step in wanted:
            out[step] = tau

    start = initial_point(task_vectors, "sum")
    if 0 in wanted:
        out[0] = start.clone()
    descend(start, quadratic_gradient(eq), steps=max(steps), lr=lr, optimizer="adam", callback=keep)
    return out


def merge_candidates(
    base: StateDict,
    experts: Sequence[StateDict],
    candidates: Sequence[Candidate],
    *,
    wudi_steps: Sequence[int] = (),
    progress: bool = True,
) -> MergedDeltas:
    """The deltas of every candidate, and of WUDI at ``wudi_steps`` (candidate label ``wudi_steps``); seeded methods
    (DARE) draw each expert's mask from its weights, as a merge of the same files does."""
    sweep = [Candidate("wudi_steps", "wudi", {"steps": s}) for s in wudi_steps]
    everything = [*candidates, *sweep]
    plans = _plans(everything, base)
    changed = changed_tensors(base, experts)
    result = MergedDeltas({c.key: {} for c in everything}, {c.key: {} for c in everything}, {})
    result.seconds = dict.fromkeys([*result.method, "wudi_steps"], 0.0)
    for name in tqdm(changed, desc="merging layers", disable=not progress):
        stack = torch.stack([e[name].float() for e in experts]) - base[name].float()
        mean = stack.mean(dim=0)
        with shared_decompositions():
            for c in candidates:
                action = plans[c.key][name]
                if action == "average":
                    result.averaged[c.key][name] = mean
                elif action == "merge":
                    start = time.perf_counter()
                    delta = get_method(c.method)(stack, tensor_name=name, **{**c.params, "scale": 1.0}).delta
                    result.seconds[c.key] += time.perf_counter() - start
                    result.method[c.key][name] = delta
        if sweep:
            if plans[sweep[0].key][name] == "merge":
                start = time.perf_counter()
                snapshots = wudi_snapshots(stack, wudi_steps)
                result.seconds["wudi_steps"] += time.perf_counter() - start
                for c in sweep:
                    result.method[c.key][name] = snapshots[c.params["steps"]]
            else:
                for c in sweep:
                    result.averaged[c.key][name] = mean
    return result
