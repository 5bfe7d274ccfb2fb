"""AdaMerging on top of any merge: per-layer coefficients on the merge's delta, learned by minimising entropy.

AdaMerging (Yang et al., ICLR 2024) learns merging coefficients without labels by minimising the Shannon entropy
of the merged model's predictions on unlabeled inputs. Here it starts from a merge specmerge (or anyone) made:
with delta = W_merged - W_0 for every tensor the merge changed, grouped by layer (:func:`layer_groups`),

    W = W_0 + lambda_g delta + sum_i mu_{g,i} tau_i        (tau_i = W_i - W_0, only with ``experts``)

for the tensors of group g, lambda_g = 1 and mu = 0 at the start, so that step 0 is the merge itself. Adam on
lambda (and mu) only, the model's own parameters frozen. :func:`adamerge_coefficients` works in memory on any
``nn.Module``; :func:`adamerge` on model folders, writing a new folder and ``adamerge.json``.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from specmerge.errors import RecipeError, SpecmergeError
from specmerge.pipeline.recipe.layered import layer_positions
from specmerge.tuning.adamerge_io import (
    adamerge_device,
    adamerge_report,
    changed_tensors,
    check_data_settings,
    input_names,
    is_data_file,
    load_model,
    make_batches,
    open_folders,
    read_examples,
    refuse_model_mismatch,
    write_adamerged,
)

OTHER = "other"  # the group of the tensors outside numbered layers (embeddings, final norm, head)

__all__ = ["OTHER", "AdaMergeResult", "adamerge", "adamerge_coefficients", "entropy_sum", "layer_groups"]


def layer_groups(names: Iterable[str]) -> dict[str, list[str]]:
    """Tensor names by layer: ``model.layers.7`` holds the names whose first all-digit component is that 7 (the
    rule of :func:`specmerge.pipeline.recipe.layered.layer_positions`), :data:`OTHER` the rest; layers in order, other
    last."""
    names = list(names)
    groups: dict[str, list[str]] = {}
    for name, position in layer_positions(names).items():
        parts = name.split(".")
        index = next(k for k, part in enumerate(parts) if part.isdigit()) if position is not None else None
        groups.setdefault(OTHER if index is None else ".".join(parts[: index + 1]), []).append(name)

    def order(key: str) -> tuple:
        prefix, _, layer = key.rpartition(".")
        return (key == OTHER, prefix, int(layer) if layer.isdigit() else -1)

    return {key: groups[key] for key in sorted(groups, key=order)}


def entropy_sum(logits: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The sum of the prediction entropies H(softmax(logits)) and how many were summed.

    ``logits`` (batch, classes): one prediction per example; (batch, seq, vocab): one per position, the positions
    where ``mask`` (batch, seq) is 0 left out. Computed from log_softmax, so large logits do not overflow and a
    class of probability 0 (a logit of -inf) adds 0.
    """
    if logits.dim() not in (2, 3):
        raise SpecmergeError(
            f"the model's forward returned logits of shape {tuple(logits.shape)}: expected (batch, classes) for a "
            "classification head or (batch, sequence, vocabulary) for next-token prediction; pass a forward that "
            "returns those logits"
        )
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    log_p = torch.log_softmax(logits, dim=-1)
    p = log_p.exp()
    entropy = -(p * torch.where(p > 0, log_p, torch.zeros_like(log_p))).sum(-1)  # 0 log 0 = 0, gradient included
    if logits.dim() == 2 or mask is None:
        return entropy.sum(), torch.tensor(entropy.numel(), dtype=entropy.dtype, device=entropy.device)
    if tuple(mask.shape) != tuple(entropy.shape):
        raise SpecmergeError(
            f"the attention mask has shape {tuple(mask.shape)} but the logits {tuple(logits.shape)}: the mask must be "
            "(batch, sequence) of the same batch"
        )
    mask = mask.to(device=entropy.device, dtype=entropy.dtype)
    return (entropy * mask).sum(), mask.sum()


def adapted_weight(merged: Tensor, delta: Tensor, lam: Tensor, mu: Tensor | None, taus: Tensor | None) -> Tensor:
    """W_merged + (lambda - 1) delta + sum_i mu_i tau_i: W_0 + lambda delta + sum_i mu_i tau_i, written from the
    merged weight so that lambda = 1, mu = 0 gives W_merged exactly."""
    weight = merged + (lam - 1) * delta
    if mu is not None and taus is not None:
        weight = weight + torch.tensordot(mu, taus, dims=1)
    return weight


@dataclass
class AdaMergeResult:
    """What :func:`adamerge_coefficients` learned: lambda per group (and mu per group and expert), the groups'
    tensor names, the mean entropy over all batches before and after, and the loss of every step."""

    coefficients: dict[str, float]
    expert_coefficients: dict[str, list[float]] | None
    groups: dict[str, list[str]]
    entropy_start: float
    entropy_end: float
    losses: list[float] = field(default_factory=list)

    def state(
        self,
        base: Mapping[str, Tensor],
        merged: Mapping[str, Tensor],
        experts: Sequence[Mapping[str, Tensor]] | None = None,
    ) -> dict[str, Tensor]:
        """The adapted state dict, every tensor in the merged tensor's dtype; tensors whose coefficients are
        still lambda = 1, mu = 0 (and those outside the groups) are the merged tensors themselves."""
        if self.expert_coefficients is not None and not experts:
            raise SpecmergeError("these coefficients include per-expert ones: pass the same experts to state()")
        out = dict(merged)
        for group, names in self.groups.items():
            lam = self.coefficients[group]
            mus = self.expert_coefficients[group] if self.expert_coefficients is not None else []
            if lam == 1.0 and not any(mus):
                continue
            for name in names:
                dtype = torch.promote_types(merged[name].dtype, torch.float32)
                w_m, w_0 = merged[name].to(dtype), base[name].to(dtype)
                mu = torch.tensor(mus, dtype=dtype) if mus else None
                taus = torch.stack([e[name].to(dtype) - w_0 for e in experts]) if mus and experts else None
                weight = adapted_weight(w_m, w_m - w_0, torch.tensor(lam, dtype=dtype), mu, taus)
                out[name] = weight.to(merged[name].dtype)
        return out


def adamerge_coefficients(
    model: nn.Module,
    base: Mapping[str, Tensor],
    merged: Mapping[str, Tensor],
    batches: Iterable[Any],
    *,
    forward: Callable[[nn.Module, Any], Tensor] | None = None,
    experts: Sequence[Mapping[str, Tensor]] | None = None,
    steps: int = 100,
    lr: float = 1e-3,
    seed: int = 0,
    progress: bool = True,
) -> AdaMergeResult:
    """Learn AdaMerging coefficients on top of the merge ``merged`` of ``base`` by minimising prediction entropy.

    ``model`` is any module whose parameter and buffer names include ``merged``'s; every tensor of ``merged`` is
    given to it by ``torch.func.functional_call`` (its own values are used only for the names ``merged`` lacks),
    and it is run in eval mode (its mode is restored after). ``forward(model, batch)`` returns the logits (default:
    ``model(**batch).logits`` for a dict batch, ``model(batch)`` otherwise, ``.logits`` taken when there): 2-D
    (batch, classes) for a classification head, 3-D (batch, sequence, vocabulary) for next-token prediction,
    whose positions with ``batch["attention_mask"] == 0`` are left out. ``experts`` (their weights W_i) add the
    per-expert coefficients mu. Adam with learning rate ``lr`` (1e-3, as AdaMerging) runs ``steps`` steps, one
    batch each, the batches cycled in an order shuffled with ``seed`` on every pass; 0 steps gives the merge.
    """
    _check_settings(steps, lr)
    experts = list(experts or [])
    changed = changed_tensors(base, merged, experts)
    batches = list(batches)
    if not batches:
        raise SpecmergeError("no batches: give at least one batch of unlabeled inputs")
    known = dict(
        itertools.chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    )
    missing = [name for name in merged if name not in known]
    if missing:
        raise SpecmergeError(
            f"the model has no parameter or buffer '{missing[0]}' of the merged state dict ({len(missing)} such "
            "names): pass the module the merged checkpoint is for"
        )
    aliases, own = _tied_names(model, merged)
    groups = layer_groups(name for name in changed if name not in aliases)
    for alias, canonical in aliases.items():  # a tied name follows its canonical tensor's coefficients
        if alias in changed:
            next(names for names in groups.values() if canonical in names).append(alias)
    weights = _Weights(known, own, base, merged, experts, groups, aliases)
    forward = _default_forward if forward is None else forward
    was_training = model.training
    model.eval()
    try:
        return _optimise(model, weights, batches, forward, steps, lr, seed, progress)
    finally:
        model.train(was_training)


def _check_settings(steps: int, lr: float) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise RecipeError(f"steps must be a whole number >= 0 (0: the merge itself), got {steps!r}", ("steps",))
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0 or lr == float("inf"):
        raise RecipeError(f"lr must be a number > 0 (AdaMerging used 1e-3), got {lr!r}", ("lr",))


def _tied_names(model: nn.Module, merged: Mapping[str, Tensor]) -> tuple[dict[str, str], dict[str, Tensor]]:
    """The names of ``merged`` tied in ``model`` to an earlier name of ``merged`` (alias -> that name), and the
    module's own tensors that no name of ``merged`` covers, detached (one name per set of tied ones)."""
    named: dict[int, list[tuple[str, Tensor]]] = {}
    for name, tensor in itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    ):
        named.setdefault(id(tensor), []).append((name, tensor))
    aliases, own = {}, {}
    for tied in named.values():
        given = [name for name, _ in tied if name in merged]
        aliases.update({alias: given[0] for alias in given[1:]})
        if not given:
            own[tied[0][0]] = tied[0][1].detach()
    return aliases, own


class _Weights:
    """The tensors given to the module: W_merged, delta and tau per changed tensor (in the dtype and on the
    device of the module's own tensor of that name), the other merged tensors as they are, and the module's own
    tensors that the merge lacks, detached; plus lambda (G) and mu (G x N), the only tensors that learn."""

    def __init__(self, known, own, base, merged, experts, groups, aliases) -> None:
        self.groups = groups
        self.fixed = dict(own)
        self.varying: list[tuple[int, str, Tensor, Tensor, Tensor | None]] = []
        grouped = {name: g for g, names in enumerate(groups.values()) for name in names}
        for name, value in merged.items():
            device = known[name].device
            if name in aliases:
                continue  # functional_call gives it its canonical tensor's value
            if name not in grouped:
                self.fixed[name] = value.to(device)
                continue
            dtype = known[name].dtype if known[name].is_floating_point() else torch.float32
            w_m, w_0 = value.to(device=device, dtype=dtype), base[name].to(device=device, dtype=dtype)
            taus = torch.stack([e[name].to(device=device, dtype=dtype) - w_0 for e in experts]) if experts else None
            self.varying.append((grouped[name], name, w_m, w_m - w_0, taus))
        device = next((tensor.device for tensor in known.values()), torch.device("cpu"))
        self.lam = torch.ones(len(groups), device=device, requires_grad=True)
        self.mu = torch.zeros(len(groups), len(experts), device=device, requires_grad=True) if experts else None

    def parameters(self) -> list[Tensor]:
        return [self.lam] if self.mu is None else [self.lam, self.mu]

    def tensors(self) -> dict[str, Tensor]:
        out = dict(self.fixed)
        for g, name, w_m, delta, taus in self.varying:
            mu = None if self.mu is None else self.mu[g].to(w_m.dtype)
            out[name] = adapted_weight(w_m, delta, self.lam[g].to(w_m.dtype), mu, taus)
        return out

    def coefficients(self) -> tuple[dict[str, float], dict[str, list[float]] | None]:
        keys = list(self.groups)
        lam = dict(zip(keys, self.lam.detach().cpu().tolist(), strict=True))
        mu = None if self.mu is None else dict(zip(keys, self.mu.detach().cpu().tolist(), strict=True))
        return lam, mu


def _default_forward(model: nn.Module, batch: Any) -> Tensor:
    if isinstance(batch, Mapping):
        device = next(itertools.chain(model.parameters(), model.buffers()), torch.empty(0)).device
        output = model(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()})
    else:
        output = model(batch)
    return getattr(output, "logits", output)


class _Forward(nn.Module):
    """``forward(model, batch)`` as a module around ``model``, so that ``functional_call`` can swap its tensors."""

    def __init__(self, model: nn.Module, forward: Callable[[nn.Module, Any], Tensor]) -> None:
        super().__init__()
        self.model = model
        self.call = forward

    def forward(self, batch: Any) -> Tensor:
        return self.call(self.model, batch)


def _batch_entropy(wrapped: _Forward, weights: _Weights, batch: Any, index: int) -> tuple[Tensor, Tensor]:
    tensors = {f"model.{name}": value for name, value in weights.tensors().items()}
    logits = torch.func.functional_call(wrapped, tensors, (batch,), strict=False, tie_weights=True)
    if not isinstance(logits, Tensor):
        raise SpecmergeError(f"the forward returned {type(logits).__name__}, not a tensor of logits: pass a forward")
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) and logits.dim() == 3 else None
    total, count = entropy_sum(logits, mask)
    if not count > 0:
        raise SpecmergeError(f"batch {index} has no prediction to score (its attention mask is all 0): drop it")
    return total, count


def _mean_entropy(wrapped: _Forward, weights: _Weights, batches: list[Any], when: str) -> float:
    """The mean entropy over every prediction of every batch (no gradient)."""
    total, count = 0.0, 0.0
    with torch.no_grad():
        for index, batch in enumerate(batches):
            s, c = _batch_entropy(wrapped, weights, batch, index)
            total, count = total + float(s), count + float(c)
    mean = total / count
    if not torch.isfinite(torch.tensor(mean)):
        raise SpecmergeError(
            f"the mean prediction entropy {when} is {mean}: the model's logits are not finite on these inputs"
        )
    return mean


def _cycled(batches: list[Any], seed: int) -> Iterator[tuple[int, Any]]:
    """The batches (with their index) in an order shuffled with ``seed`` on each pass, forever."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        for index in torch.randperm(len(batches), generator=generator).tolist():
            yield index, batches[index]


def _optimise(model, weights, batches, forward, steps, lr, seed, progress) -> AdaMergeResult:
    wrapped = _Forward(model, forward)
    start = _mean_entropy(wrapped, weights, batches, "of the merged model")
    optimizer = torch.optim.Adam(weights.parameters(), lr=lr)
    losses = []
    order = _cycled(batches, seed)
    with tqdm(total=steps, desc="adamerge", unit="step", disable=not progress) as bar:
        for step in range(steps):
            index, batch = next(order)
            optimizer.zero_grad(set_to_none=True)
            total, count = _batch_entropy(wrapped, weights, batch, index)
            loss = total / count
            if not torch.isfinite(loss):
                raise SpecmergeError(
                    f"the entropy became {loss.item()} at step {step} (batch {index}): the coefficients diverged; "
                    f"lower the learning rate (now {lr}) or the number of steps"
                )
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            bar.set_postfix(entropy=f"{losses[-1]:.4f}")
            bar.update()
    end = _mean_entropy(wrapped, weights, batches, "after the last step") if steps else start
    coefficients, per_expert = weights.coefficients()
    return AdaMergeResult(coefficients, per_expert, weights.groups, start, end, losses)


def adamerge(
    base: str | os.PathLike,
    merged: str | os.PathLike,
    output: str | os.PathLike,
    *,
    data: str | os.PathLike | Iterable[Mapping[str, Tensor]],
    task: str = "causal-lm",
    experts: Sequence[str | os.PathLike] | None = None,
    steps: int = 100,
    lr: float = 1e-3,
    batch_size: int = 8,
    max_length: int = 128,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
    device: str = "cpu",
) -> dict[str, Any]:
    """AdaMerging on the merge ``merged`` (a model folder) of ``base``: write the adapted model to the new folder
    ``output``, with ``adamerge.json``; return that report.

    ``data``: a text file (one input per line), a ``.jsonl`` file (a ``"text"`` or ``"input_ids"`` field per
    line) or an iterable of tokenized batches (dicts for the model). ``task`` "causal-lm" loads the merged folder
    as ``AutoModelForCausalLM`` and minimises the next-token entropy, "classification" as
    ``AutoModelForSequenceClassification`` and minimises the entropy of the head's classes. ``experts`` (model
    folders) add per-expert coefficients. The rest as :func:`adamerge_coefficients`; texts are cut at
    ``max_length`` tokens and batched by ``batch_size``. ``device`` (cpu, cuda, cuda:N, auto) runs the model and
    the coefficients' weights there (on a GPU it holds the model, and the merged, base and expert weights of the
    changed tensors); the adapted weights are computed and written from the CPU copies, the same on any device to
    float rounding. Nothing is written unless all succeeds.
    """
    started = time.perf_counter()
    _check_settings(steps, lr)
    on = adamerge_device(device)
    check_data_settings(task, batch_size, max_length)
    output, experts = Path(output), list(experts or [])
    examples = read_examples(data) if is_data_file(data) else None  # a bad data file is refused before any tensor
    with ExitStack() as stack:
        folders = open_folders(stack, base, merged, experts, output, overwrite, data)
        model = load_model(folders.merged_path, task).to(on)
        states = [folders.state(k) for k in range(len(folders.sources))]
        refuse_model_mismatch(model, states[1], task)
        if examples is None:
            batches = list(data)
        else:
            batches = make_batches(examples, folders.merged_path, model, batch_size, max_length)
        result = adamerge_coefficients(
            model, states[0], states[1], batches, experts=states[2:], steps=steps, lr=lr, seed=seed, progress=progress
        )
        names = input_names(folders, output, data)
        settings = {"task": task, "steps": steps, "lr": lr, "batch_size": batch_size, "max_length": max_length,
                    "device": str(on)}  # fmt: skip
        report = adamerge_report(result, names, {**settings, "seed": seed}, len(batches), started)
        write_adamerged(output, overwrite, folders, result.state(states[0], states[1], states[2:]), report)
    return report
