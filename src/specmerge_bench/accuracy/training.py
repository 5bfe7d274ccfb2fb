"""Fine-tuning the accuracy benchmark's experts: a full fine-tune of the encoder's linear layers, or a LoRA adapter.

Both minimise the frozen probe head's cross-entropy on one task's train split (``fit_through_head``: AdamW,
linear warmup then linear decay to zero, dropout on; the protocol is stated in :mod:`specmerge_bench.accuracy.model`):

- ``train_expert`` trains the weights and biases of the encoder's ``nn.Linear`` modules (36 in MiniLM; embeddings
  and LayerNorms stay bit-identical to the base) and returns the full state dict;
- ``train_lora_expert`` trains a PEFT LoRA adapter (rank 16, ``lora_alpha`` 32 by default) on the same 36 layers
  (``LORA_TARGETS``), the base weights frozen, and returns the ``peft.PeftModel``.

``EXPERTS_CODE`` and ``LORA_CODE`` list the functions whose source each experts stage's cache key hashes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import peft
import torch
import transformers
from torch import Tensor

from specmerge_bench.accuracy import precision
from specmerge_bench.accuracy.model import EncodedSplit, Head, forward_pooled

# PEFT target_modules (a full-match pattern): the encoder's 36 linear layers, the ones the full fine-tune trains.
LORA_TARGETS = (
    r"encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense|intermediate\.dense"
    r"|output\.dense)"
)


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


def fit_through_head(
    model: transformers.BertModel,
    parameters: Iterable[torch.nn.Parameter],
    train: EncodedSplit,
    head: Head,
    seed: int,
    steps: int,
    lr: float,
    batch_size: int,
    warmup: float,
    weight_decay: float,
    autocast: bool | None,
) -> None:
    """Train ``parameters`` of ``model`` in place on ``train`` through the frozen ``head``.

    AdamW at ``lr`` with ``warmup`` × steps of linear warmup then linear decay to zero, dropout on; batches walk
    through a fresh permutation of ``train`` per epoch. ``seed`` fixes the batch order and dropout (in a forked
    RNG: the global RNG is untouched), so equal inputs give identical parameters.
    """
    optimizer = torch.optim.AdamW(list(parameters), lr=lr, weight_decay=weight_decay)
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
    model.eval()


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
    """Fine-tune a copy of ``base_model``'s ``encoder_linear_parameters`` on ``train`` through the frozen ``head``
    (``fit_through_head``); return its full float32 state dict, every other tensor equal to the base's.
    ``base_model`` is not modified."""
    model = copy.deepcopy(base_model)
    model.requires_grad_(False)
    trainable = encoder_linear_parameters(model)
    for parameter in trainable.values():
        parameter.requires_grad_(True)
    fit_through_head(
        model, trainable.values(), train, head, seed, steps, lr, batch_size, warmup, weight_decay, autocast
    )
    return {name: tensor.detach().to(torch.float32).clone() for name, tensor in model.state_dict().items()}


def lora_config(rank: int = 16, alpha: float = 32) -> peft.LoraConfig:
    """The benchmark's LoRA adapters: ``rank`` on ``LORA_TARGETS``, no LoRA dropout (the encoder's own is on),
    no biases; the delta of each layer is ``alpha / rank * B @ A``."""
    return peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=LORA_TARGETS, lora_dropout=0.0, bias="none")


def train_lora_expert(
    base_model: transformers.BertModel,
    train: EncodedSplit,
    head: Head,
    seed: int,
    steps: int = 800,
    lr: float = 5e-4,
    batch_size: int = 32,
    warmup: float = 0.1,
    weight_decay: float = 0.0,
    autocast: bool | None = None,
    rank: int = 16,
    alpha: float = 32,
) -> peft.PeftModel:
    """A PEFT LoRA adapter (``lora_config``) on a copy of ``base_model``, trained on ``train`` through the frozen
    ``head`` (``fit_through_head``), in eval mode; ``seed`` also fixes the factors' initialisation (PEFT's:
    Kaiming-uniform A, zero B). Only the adapter's factors train; ``base_model`` is not modified."""
    model = copy.deepcopy(base_model)
    model.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        adapted = peft.get_peft_model(model, lora_config(rank, alpha))
    trainable = [parameter for parameter in adapted.parameters() if parameter.requires_grad]
    fit_through_head(model, trainable, train, head, seed, steps, lr, batch_size, warmup, weight_decay, autocast)
    return adapted


EXPERTS_CODE = (forward_pooled, encoder_linear_parameters, warmup_linear_decay, fit_through_head, train_expert)
LORA_CODE = (forward_pooled, warmup_linear_decay, fit_through_head, lora_config, train_lora_expert)
