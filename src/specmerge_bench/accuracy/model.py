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
- **Experts.** ``train_expert`` (:mod:`.training`) fine-tunes the encoder's ``nn.Linear`` weights and biases
  only (36 in MiniLM; embeddings and LayerNorms stay bit-identical to the base), minimising the frozen head's
  cross-entropy with AdamW, linear warmup then linear decay to zero, dropout on. Weight decay defaults to 0:
  AdamW's decay pulls weights toward zero, which would add the same task-independent ``-c·W_base``
  component to every task vector.
- **Scores.** Accuracy of ``argmax(head(features))`` per task (``evaluate``), on val (for choices) or test.
- **AdaMerging** (:mod:`specmerge_bench.accuracy.adamerging`) gets a split's inputs without labels
  (``unlabeled_inputs``) and every task's head logits on them (``multitask_logits``).

The cached stages that use these functions (tokens, probes, experts) are in
:mod:`specmerge_bench.accuracy.experts`; the source of the functions each stage depends on (``TOKENS_CODE``,
``PROBES_CODE``, ``EXPERTS_CODE`` below) is hashed into that stage's cache key.
"""

from __future__ import annotations

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


def forward_pooled(model: transformers.BertModel, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Pooled features of one batch, the encoder run on its real tokens only ("packed").

    The same function as ``mean_pool(model(input_ids, attention_mask).last_hidden_state, attention_mask)`` (a
    test checks it in float64): a BERT layer acts on each token separately except in attention, and attention
    masks the padding keys, so the padded positions never reach a real token. Here the embeddings run on the
    batch cut to its longest row; every linear layer, LayerNorm, GELU and dropout runs on the T real tokens
    (T x hidden) instead of batch x longest; only attention scatters them back to batch x longest (padded keys
    masked). In training batches (random rows, a longest row about twice the mean) that halves the work of the
    linear layers. The modules are called as they are (``model.encoder.layer[i].attention.self.query`` ...), so
    a PEFT LoRA-wrapped or ``functional_call``-substituted model runs the same way.
    """
    length = int(attention_mask.sum(1).max())
    mask = attention_mask[:, :length].bool()
    batch = mask.shape[0]
    hidden = model.embeddings(input_ids=input_ids[:, :length])
    width = hidden.shape[-1]
    real = mask.reshape(-1).nonzero().squeeze(1)  # positions of the real tokens in the flattened batch
    tokens = hidden.reshape(-1, width)[real]
    keys = mask[:, None, None, :]  # attend to real keys only
    for layer in model.encoder.layer:
        attention = layer.attention.self
        heads = attention.num_attention_heads
        packed = torch.cat([attention.query(tokens), attention.key(tokens), attention.value(tokens)], dim=1)
        padded = packed.new_zeros(batch * length, 3 * width).index_copy(0, real, packed)
        q, k, v = padded.view(batch, length, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
        dropout = attention.dropout.p if attention.training else 0.0
        context = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keys, dropout_p=dropout)
        context = context.transpose(1, 2).reshape(batch * length, width)[real]
        out = layer.attention.output
        tokens = out.LayerNorm(out.dropout(out.dense(context)) + tokens)
        out = layer.output
        tokens = out.LayerNorm(out.dropout(out.dense(layer.intermediate(tokens))) + tokens)
    dtype = torch.promote_types(tokens.dtype, torch.float32)  # float32 features (float64 for a float64 model)
    sums = torch.zeros(batch, width, dtype=dtype).index_add_(0, real // length, tokens.to(dtype))
    return sums / mask.sum(1, keepdim=True).clamp(min=1).to(dtype)


def pooled_features(
    model: transformers.BertModel, encoded: Mapping[str, Tensor], batch_size: int = 256, autocast: bool | None = None
) -> Tensor:
    """Mean-pooled last hidden states (n × hidden; float32, float64 for a float64 model) of ``encoded`` inputs,
    in eval mode, without grad.

    Rows are batched in order of length (stable), so a row's result depends only on the inputs and the batch
    size. ``autocast`` runs the forward under bfloat16 autocast. The model's train / eval mode is restored.
    """
    input_ids, attention_mask = encoded["input_ids"], encoded["attention_mask"]
    order = torch.argsort(attention_mask.sum(1), stable=True)
    dtype = torch.promote_types(model.embeddings.word_embeddings.weight.dtype, torch.float32)
    out = torch.empty(len(input_ids), model.config.hidden_size, dtype=dtype)
    was_training = model.training
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision.autocast(autocast)):
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            out[rows] = forward_pooled(model, input_ids[rows], attention_mask[rows])
    model.train(was_training)
    return out


# ------------------------------------------------------------------------------------------------ probes


def accuracy(head: Head, features: Tensor, labels: Tensor) -> float:
    """Fraction of rows whose argmax logit is the label."""
    return float((head.logits(features).argmax(1) == labels).to(torch.float64).mean())


def correct(model: transformers.BertModel, encoded: EncodedSplit, head: Head) -> Tensor:
    """Per-sentence correctness (bool, n) of ``model`` with ``head`` on one encoded split (``pooled_features``'
    batching and precision, so its mean is ``evaluate``'s accuracy)."""
    features = pooled_features(model, encoded.inputs)
    return head.logits(features).argmax(1) == encoded.labels


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
            features = forward_pooled(model, inputs["input_ids"], inputs["attention_mask"])
        parts.append(heads[task].logits(features))
    width = max(part.shape[1] for part in parts)
    return torch.cat([torch.cat([p, p.new_full((len(p), width - p.shape[1]), -torch.inf)], dim=1) for p in parts])


# The functions (and classes) whose source each cached stage's key hashes, in the order hashed
# (:mod:`specmerge_bench.accuracy.experts`; the experts' in :mod:`.training`): a change to one of them rebuilds
# that stage.
TOKENS_CODE = (encode, EncodedSplit)
PROBES_CODE = (forward_pooled, pooled_features, accuracy, fit_logistic, fit_probe)
