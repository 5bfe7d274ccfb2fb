"""Model stage of the offline accuracy benchmark: frozen probe heads, one fine-tuned expert per task, scoring.

Protocol (one base encoder, the pinned all-MiniLM-L6-v2 ``BertModel`` without its pooler):

- **Inputs.** Texts are tokenized once, truncated and padded to ``max_length`` (32) tokens, single segment
  (no ``token_type_ids``: ``BertModel`` uses zeros). A forward pass sorts the texts by length and cuts each
  batch to its longest row; padding never reaches the pooled features.
- **Features.** Mean of the last hidden states over the attention mask, in float32. Forward passes run under
  bfloat16 autocast where the CPU runs bf16 natively, float32 elsewhere (:mod:`.precision`; ``autocast=None``
  follows the run's precision, a bool overrides it): with native bf16 that is about 4× faster than float32,
  and the benchmark fits, trains and scores with the same setting, so the heads see the model they are used
  with.
- **Heads.** Per task a multinomial logistic regression on the base model's features (``fit_probe``), fitted
  on train, L2 strength chosen on val; standardisation is folded into the weights, so a ``Head`` maps raw
  pooled features to logits. Heads stay frozen afterwards.
- **Experts.** ``train_expert`` fine-tunes the encoder's ``nn.Linear`` weights and biases only (36 in MiniLM;
  embeddings and LayerNorms stay bit-identical to the base), minimising the frozen head's cross-entropy with
  AdamW, linear warmup then linear decay to zero, dropout on. Weight decay defaults to 0: AdamW's decay pulls
  weights toward zero, which would add the same task-independent ``-c·W_base`` component to every task vector.
- **Scores.** Accuracy of ``argmax(head(features))`` per task (``evaluate``), on val (for choices) or test.
- **AdaMerging** (:mod:`specmerge_bench.accuracy.adamerging`) gets a split's inputs without labels
  (``unlabeled_inputs``) and every task's head logits on them (``multitask_logits``).

The cached stages that use these functions (tokens, probes, experts) are in
:mod:`specmerge_bench.accuracy.experts`; the source of the functions each stage depends on (``TOKENS_CODE``,
``PROBES_CODE``, ``EXPERTS_CODE`` below) is hashed into that stage's cache key.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
import transformers
from torch import Tensor

from specmerge_bench.accuracy import precision
from specmerge_bench.accuracy.base_model import load_base_model_path

MAX_LENGTH = 32
L2_GRID = (1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6)
EVAL_SPLITS = ("val", "test")
# Keys of a saved BertModel that the pooler-less model does not hold; dropped when loading a state.
IGNORED_KEYS = ("pooler.dense.weight", "pooler.dense.bias", "embeddings.position_ids")
# Files of a model folder that fix its outputs (the ones present are hashed into cache keys).
MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)


@dataclass(frozen=True)
class EncodedSplit:
    """One tokenized split: ``input_ids`` and ``attention_mask`` (int64, n × max_length), ``labels`` (int64, n)."""

    input_ids: Tensor
    attention_mask: Tensor
    labels: Tensor

    @property
    def inputs(self) -> dict[str, Tensor]:
        """The model inputs, as ``encode`` returns them."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class Head:
    """A linear classifier on raw pooled features: ``logits = features @ weight.T + bias``.

    ``weight`` is n_classes × hidden, ``bias`` n_classes, both float32; ``l2`` records the L2 strength it was
    fitted with (provenance only).
    """

    weight: Tensor
    bias: Tensor
    l2: float

    def logits(self, features: Tensor) -> Tensor:
        """Class logits of float32 features (n × hidden)."""
        return features @ self.weight.T + self.bias


# ------------------------------------------------------------------------------------------ model, inputs


def load_base(
    model_dir: str | Path | None = None,
) -> tuple[transformers.BertModel, transformers.PreTrainedTokenizerBase]:
    """The base encoder (``BertModel`` without pooler, float32, eval mode) and its tokenizer, from one folder.

    ``model_dir`` defaults to the pinned MiniLM (``load_base_model_path``, hashes checked). Files are read
    locally only; ``HF_HUB_OFFLINE=1`` is set for the rest of the process.
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    folder = Path(model_dir) if model_dir is not None else load_base_model_path()
    config = transformers.BertConfig.from_pretrained(folder, local_files_only=True)
    model = transformers.BertModel(config, add_pooling_layer=False)
    load_state(model, safetensors.torch.load_file(folder / "model.safetensors"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model.eval(), tokenizer


def load_state(model: transformers.BertModel, state: Mapping[str, Tensor]) -> None:
    """Copy ``state`` (``BertModel.state_dict()`` names, any float dtype) into ``model`` in place.

    Pooler weights and ``embeddings.position_ids`` (present in files saved with a pooler) are ignored; any
    other missing or unknown name is an error.
    """
    kept = {name: tensor for name, tensor in state.items() if name not in IGNORED_KEYS}
    expected = model.state_dict().keys()
    missing, unknown = sorted(expected - kept.keys()), sorted(kept.keys() - expected)
    if missing or unknown:
        raise ValueError(
            f"state does not fit the encoder: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unknown {unknown[:5]}{'...' if len(unknown) > 5 else ''}; pass a BertModel.state_dict()"
        )
    model.load_state_dict(kept, strict=True)


def encode(
    tokenizer: transformers.PreTrainedTokenizerBase, texts: Sequence[str], max_length: int = MAX_LENGTH
) -> dict[str, Tensor]:
    """``input_ids`` and ``attention_mask`` (int64, len(texts) × max_length): truncated, right-padded to max_length."""
    batch = tokenizer(list(texts), max_length=max_length, truncation=True, padding="max_length", return_tensors="pt")
    return {"input_ids": batch["input_ids"].long(), "attention_mask": batch["attention_mask"].long()}


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean of ``hidden`` (n × length × hidden) over the positions where ``attention_mask`` is 1, in float32."""
    mask = attention_mask.unsqueeze(-1).to(torch.float32)
    return (hidden.to(torch.float32) * mask).sum(1) / mask.sum(1).clamp(min=1.0)


def _forward_pooled(model: transformers.BertModel, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Pooled features of one batch, cut to its longest row."""
    length = int(attention_mask.sum(1).max())
    mask = attention_mask[:, :length]
    hidden = model(input_ids=input_ids[:, :length], attention_mask=mask).last_hidden_state
    return mean_pool(hidden, mask)


def pooled_features(
    model: transformers.BertModel, encoded: Mapping[str, Tensor], batch_size: int = 256, autocast: bool | None = None
) -> Tensor:
    """Mean-pooled last hidden states (float32, n × hidden) of ``encoded`` inputs, in eval mode, without grad.

    Rows are batched in order of length (stable), so a row's result depends only on the inputs and the batch
    size. ``autocast`` runs the forward under bfloat16 autocast. The model's train / eval mode is restored.
    """
    input_ids, attention_mask = encoded["input_ids"], encoded["attention_mask"]
    order = torch.argsort(attention_mask.sum(1), stable=True)
    out = torch.empty(len(input_ids), model.config.hidden_size)
    was_training = model.training
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision.autocast(autocast)):
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            out[rows] = _forward_pooled(model, input_ids[rows], attention_mask[rows])
    model.train(was_training)
    return out


# ------------------------------------------------------------------------------------------------ probes


def accuracy(head: Head, features: Tensor, labels: Tensor) -> float:
    """Fraction of rows whose argmax logit is the label."""
    return float((head.logits(features).argmax(1) == labels).to(torch.float64).mean())


def fit_logistic(features: Tensor, labels: Tensor, l2: float, init: Head | None = None) -> Head:
    """Multinomial logistic regression: minimise mean cross-entropy + ``l2``/2 · ||W||² on standardised features.

    Features are standardised per dimension (train mean and std) for conditioning, and the scaling is folded
    back, so the returned head acts on raw features and the penalty is on the standardised weights. Full-batch
    L-BFGS (strong Wolfe) in float64 from zero, or from ``init`` (a head fitted on the same features); the
    bias is not penalised. Deterministic.
    """
    x = features.to(torch.float64)
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
    z = (x - mean) / std
    n_classes = int(labels.max()) + 1
    if init is None:
        weight = torch.zeros(n_classes, x.shape[1], dtype=torch.float64)
        bias = torch.zeros(n_classes, dtype=torch.float64)
    else:  # unfold init back to standardised coordinates
        weight = init.weight.to(torch.float64) * std
        bias = init.bias.to(torch.float64) + init.weight.to(torch.float64) @ mean
    weight.requires_grad_(True)
    bias.requires_grad_(True)
    optimizer = torch.optim.LBFGS(
        [weight, bias],
        lr=1.0,
        max_iter=500,
        history_size=20,
        tolerance_grad=1e-8,
        tolerance_change=1e-12,
        line_search_fn="strong_wolfe",
    )

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(z @ weight.T + bias, labels) + 0.5 * l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    weight, bias = weight.detach() / std, bias.detach()
    return Head(weight=weight.float(), bias=(bias - weight @ mean).float(), l2=l2)


def fit_probe(
    train_features: Tensor,
    train_labels: Tensor,
    val_features: Tensor,
    val_labels: Tensor,
    l2_grid: Sequence[float] = L2_GRID,
) -> Head:
    """The ``fit_logistic`` head with the best val accuracy over ``l2_grid`` (ties: the stronger L2).

    The grid is fitted from the strongest L2 down, each fit warm-started from the previous one.
    """
    best, best_accuracy, previous = None, -1.0, None
    for l2 in sorted(l2_grid, reverse=True):
        previous = fit_logistic(train_features, train_labels, l2, init=previous)
        score = accuracy(previous, val_features, val_labels)
        if score > best_accuracy:
            best, best_accuracy = previous, score
    if best is None:
        raise ValueError("l2_grid is empty")
    return best


# ------------------------------------------------------------------------------------------------ scoring


def evaluate(
    model_or_state: transformers.BertModel | Mapping[str, Tensor],
    tasks_encoded: Mapping[str, Mapping[str, EncodedSplit]],
    heads: Mapping[str, Head],
    split: str,
    *,
    scratch: transformers.BertModel | None = None,
    batch_size: int = 256,
    autocast: bool | None = None,
) -> dict[str, float]:
    """Accuracy per task of ``tasks_encoded`` on ``split``, each scored with ``heads[task]``.

    ``model_or_state`` is a ``BertModel`` (used as is; its train / eval mode is restored) or a state dict with
    ``BertModel.state_dict()`` names, which is copied into ``scratch`` (a model of the same config whose
    weights are overwritten; reuse one across calls). ``autocast`` as in ``pooled_features``.
    """
    if isinstance(model_or_state, transformers.BertModel):
        model = model_or_state
    elif scratch is None:
        raise ValueError("evaluate got a state dict: pass scratch=<BertModel of the same config> to load it into")
    else:
        load_state(scratch, model_or_state)
        model = scratch
    scores = {}
    for task, splits in tasks_encoded.items():
        encoded = splits[split]
        features = pooled_features(model, encoded.inputs, batch_size=batch_size, autocast=autocast)
        scores[task] = accuracy(heads[task], features, encoded.labels)
    return scores


def unlabeled_inputs(
    tasks_encoded: Mapping[str, Mapping[str, EncodedSplit]], split: str
) -> dict[str, dict[str, Tensor]]:
    """Task -> the model inputs of ``split`` (``input_ids``, ``attention_mask``), without their labels."""
    return {task: splits[split].inputs for task, splits in tasks_encoded.items()}


def multitask_logits(
    model: transformers.BertModel,
    batch: Mapping[str, Mapping[str, Tensor]],
    heads: Mapping[str, Head],
    autocast: bool | None = None,
) -> Tensor:
    """Each task's head logits on that task's inputs in ``batch`` (task -> inputs), with gradient, stacked in task
    order: (rows, most classes), a task with fewer classes padded with -inf (classes of probability 0)."""
    parts = []
    for task, inputs in batch.items():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision.autocast(autocast)):
            features = _forward_pooled(model, inputs["input_ids"], inputs["attention_mask"])
        parts.append(heads[task].logits(features))
    width = max(part.shape[1] for part in parts)
    return torch.cat([torch.cat([p, p.new_full((len(p), width - p.shape[1]), -torch.inf)], dim=1) for p in parts])


# ------------------------------------------------------------------------------------------------ experts


def encoder_linear_parameters(model: transformers.BertModel) -> dict[str, torch.nn.Parameter]:
    """Weights and biases of the ``nn.Linear`` modules inside ``model.encoder``, by state-dict name."""
    return {
        f"encoder.{module_name}.{name}": parameter
        for module_name, module in model.encoder.named_modules()
        if isinstance(module, torch.nn.Linear)
        for name, parameter in module.named_parameters(recurse=False)
    }


def warmup_linear_decay(step: int, steps: int, warmup_steps: int) -> float:
    """Learning-rate factor of optimizer step ``step`` (0-based): linear up to 1 over ``warmup_steps``, then to 0."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return max(0.0, (steps - step) / max(1, steps - warmup_steps))


def train_expert(
    base_model: transformers.BertModel,
    train: EncodedSplit,
    head: Head,
    seed: int,
    steps: int = 800,
    lr: float = 1e-4,
    batch_size: int = 32,
    warmup: float = 0.1,
    weight_decay: float = 0.0,
    autocast: bool | None = None,
) -> dict[str, Tensor]:
    """Fine-tune a copy of ``base_model`` on ``train`` through the frozen ``head``; return its full state dict.

    Only ``encoder_linear_parameters`` are trained (AdamW, ``lr`` with ``warmup`` × steps of linear warmup then
    linear decay to zero, dropout on); every other tensor of the returned float32 state equals the base's.
    Batches walk through a fresh permutation of ``train`` per epoch. ``seed`` fixes the batch order and dropout
    (in a forked RNG: the global RNG is untouched), so equal inputs give an identical state. ``base_model`` is
    not modified.
    """
    model = copy.deepcopy(base_model)
    model.requires_grad_(False)
    trainable = encoder_linear_parameters(model)
    for parameter in trainable.values():
        parameter.requires_grad_(True)
    optimizer = torch.optim.AdamW(trainable.values(), lr=lr, weight_decay=weight_decay)
    warmup_steps = round(warmup * steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_linear_decay(step, steps, warmup_steps))
    generator = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            if len(order) < batch_size:
                order = torch.cat([order, torch.randperm(len(train), generator=generator)])
            rows, order = order[:batch_size], order[batch_size:]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision.autocast(autocast)):
                features = _forward_pooled(model, train.input_ids[rows], train.attention_mask[rows])
            loss = torch.nn.functional.cross_entropy(head.logits(features), train.labels[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    return {name: tensor.detach().to(torch.float32).clone() for name, tensor in model.state_dict().items()}


# The functions (and classes) whose source each cached stage's key hashes, in the order hashed
# (:mod:`specmerge_bench.accuracy.experts`): a change to one of them rebuilds that stage.
TOKENS_CODE = (encode, EncodedSplit)
PROBES_CODE = (mean_pool, _forward_pooled, pooled_features, accuracy, fit_logistic, fit_probe)
EXPERTS_CODE = (_forward_pooled, mean_pool, encoder_linear_parameters, warmup_linear_decay, train_expert)
