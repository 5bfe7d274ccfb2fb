"""Fine-tuning the accuracy benchmark's experts: one full fine-tune of the encoder's linear layers per task.

``train_expert`` fine-tunes the encoder's ``nn.Linear`` weights and biases only (36 in MiniLM; embeddings and
LayerNorms stay bit-identical to the base), minimising the frozen probe head's cross-entropy with AdamW, linear
warmup then linear decay to zero, dropout on; the protocol is stated in :mod:`specmerge_bench.accuracy.model`.
``EXPERTS_CODE`` lists the functions whose source the experts stage's cache key hashes.
"""

from __future__ import annotations

import copy

import torch
import transformers
from torch import Tensor

from specmerge_bench.accuracy import precision
from specmerge_bench.accuracy.model import EncodedSplit, Head, forward_pooled


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
                features = forward_pooled(model, train.input_ids[rows], train.attention_mask[rows])
            loss = torch.nn.functional.cross_entropy(head.logits(features), train.labels[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    return {name: tensor.detach().to(torch.float32).clone() for name, tensor in model.state_dict().items()}


EXPERTS_CODE = (forward_pooled, encoder_linear_parameters, warmup_linear_decay, train_expert)
