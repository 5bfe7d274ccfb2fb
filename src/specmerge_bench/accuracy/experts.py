"""Cached model stages of the accuracy benchmark: tokens, probe heads and one expert per (seed, task).

Cache layout under ``cache_dir`` (``build_experts``); each ``<key>`` is the first 16 hex digits of a SHA-256
over the stage's inputs (upstream key, input file hashes, settings, library versions and the source of the
functions that compute it), so a rerun with the same inputs only reads files:

- ``tokens/<key>/encoded.safetensors``: ``<task>/<split>/{input_ids,attention_mask,labels}``; ``tokens.json``.
- ``probes/<key>/heads.safetensors``: ``<task>/{weight,bias}``; ``probes.json``: chosen L2, val accuracy per
  L2, base val / test accuracy per task, times.
- ``experts/<key>/seed<k>/<task>/``: ``model.safetensors`` (the full ``BertModel`` state dict, float32) and
  ``config.json`` (a Hugging Face folder, like the base model's), ``scores.json`` (val / test accuracy on its own
  task, times); ``experts/<key>/summary-seeds-<k,...>.json``: what ``build_experts`` returns.
- ``lora-experts/<key>/seed<k>/<task>/`` (the LoRA track): ``adapter_config.json`` and
  ``adapter_model.safetensors`` (PEFT's format) and ``scores.json``; a summary as above.

``python -m specmerge_bench.accuracy.experts --cache DIR [--seeds 0] [--steps 800] [--lr LR] [--track lora]``
builds them and prints the experts' accuracies.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import peft
import safetensors.torch
import torch
import transformers
from torch import Tensor

from specmerge_bench.accuracy import precision
from specmerge_bench.accuracy.base_model import load_base_model_path
from specmerge_bench.accuracy.cache_files import (
    code_digest,
    digest,
    load_encoded,
    load_heads,
    model_files,
    publish,
    read_json,
    save_encoded,
    save_heads,
    staging_folder,
    took,
    write_json,
)
from specmerge_bench.accuracy.data import SPLITS, AccuracyDataError, build_tasks, read_split
from specmerge_bench.accuracy.model import (
    EVAL_SPLITS,
    L2_GRID,
    MAX_LENGTH,
    PROBES_CODE,
    TOKENS_CODE,
    EncodedSplit,
    Head,
    accuracy,
    encode,
    evaluate,
    fit_probe,
    load_base,
    pooled_features,
)
from specmerge_bench.accuracy.training import EXPERTS_CODE, LORA_CODE, train_expert, train_lora_expert


def _tokens_stage(
    cache_dir: Path, manifest: Mapping, tokenizer_files: Mapping[str, str], tokenizer
) -> tuple[Path, dict]:
    inputs = {
        "splits": {task: entry["splits"] for task, entry in manifest["tasks"].items()},
        "tokenizer": tokenizer_files,
        "max_length": MAX_LENGTH,
        "transformers": transformers.__version__,
        "code": code_digest(*TOKENS_CODE, save_encoded),
    }
    final = cache_dir / "tokens" / digest(inputs)[:16]
    if (final / "tokens.json").is_file():
        return final, {**read_json(final / "tokens.json"), "cached": True}
    start = time.perf_counter()
    tasks_encoded = {}
    for task in manifest["tasks"]:
        tasks_encoded[task] = {}
        for split in SPLITS:
            rows = read_split(cache_dir / manifest["tasks_dir"] / task / f"{split}.jsonl")
            encoded = encode(tokenizer, [text for text, _ in rows])
            labels = torch.tensor([label for _, label in rows], dtype=torch.long)
            tasks_encoded[task][split] = EncodedSplit(encoded["input_ids"], encoded["attention_mask"], labels)
    staging = staging_folder(final)
    save_encoded(tasks_encoded, staging / "encoded.safetensors")
    record = {"inputs": inputs, "seconds": time.perf_counter() - start}
    write_json(staging / "tokens.json", record)
    publish(staging, final)
    return final, {**record, "cached": False}


def _probes_stage(
    cache_dir: Path, tokens_dir: Path, model_files: Mapping[str, str], base: transformers.BertModel, tasks_encoded
) -> tuple[Path, dict]:
    inputs = {
        "tokens": tokens_dir.name,
        "model": model_files,
        "l2_grid": list(L2_GRID),
        "precision": precision.tag(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "code": code_digest(*PROBES_CODE),
    }
    final = cache_dir / "probes" / digest(inputs)[:16]
    if (final / "probes.json").is_file():
        return final, {**read_json(final / "probes.json"), "cached": True}
    heads, tasks, feature_seconds, fit_seconds = {}, {}, 0.0, 0.0
    for task, splits in tasks_encoded.items():
        start = time.perf_counter()
        train = pooled_features(base, splits["train"].inputs)
        val = pooled_features(base, splits["val"].inputs)
        fitted = time.perf_counter()
        heads[task] = fit_probe(train, splits["train"].labels, val, splits["val"].labels)
        feature_seconds += fitted - start
        fit_seconds += time.perf_counter() - fitted
        tasks[task] = {"l2": heads[task].l2, "train": accuracy(heads[task], train, splits["train"].labels)}
    start = time.perf_counter()
    base_scores = {split: evaluate(base, tasks_encoded, heads, split) for split in EVAL_SPLITS}
    eval_seconds = time.perf_counter() - start
    eval_sentences = sum(len(splits[split]) for splits in tasks_encoded.values() for split in EVAL_SPLITS)
    for task in tasks:
        tasks[task].update({split: base_scores[split][task] for split in EVAL_SPLITS})
    record = {
        "inputs": inputs,
        "tasks": tasks,
        "seconds": {"features": feature_seconds, "fit": fit_seconds, "base_eval": eval_seconds},
        "eval_sentences_per_second": eval_sentences / eval_seconds,
    }
    staging = staging_folder(final)
    save_heads(heads, staging / "heads.safetensors")
    write_json(staging / "probes.json", record)
    publish(staging, final)
    return final, {**record, "cached": False}


def _save_full(base: transformers.BertModel, state: Mapping[str, Tensor], staging: Path) -> dict[str, Tensor]:
    safetensors.torch.save_file(dict(state), staging / "model.safetensors", metadata={"format": "pt"})
    base.config.to_json_file(staging / "config.json")
    return dict(state)


def _save_lora(base: transformers.BertModel, adapted, staging: Path) -> dict[str, Tensor]:
    adapted.save_pretrained(staging)  # PEFT's format: adapter_config.json, adapter_model.safetensors
    return adapted.merge_and_unload().state_dict()  # scored as its merge_and_unload checkpoint


@dataclass(frozen=True)
class Track:
    """How one kind of expert is trained, saved (a model folder, or a PEFT adapter) and keyed in the cache."""

    folder: str  # cache subfolder
    code: tuple  # the functions whose source the stage's key hashes
    train: Callable  # training.train_expert / train_lora_expert
    save: Callable[[transformers.BertModel, Any, Path], dict[str, Tensor]]  # writes the files, returns the state
    defaults: Mapping[str, Any]  # hyperparameters of this track beyond the shared ones


TRACKS = {
    "full": Track("experts", EXPERTS_CODE, train_expert, _save_full, {"lr": 1e-4}),
    "lora": Track("lora-experts", LORA_CODE, train_lora_expert, _save_lora, {"lr": 5e-4, "rank": 16, "alpha": 32}),
}


def _expert(
    folder: Path,
    track: Track,
    base: transformers.BertModel,
    scratch: transformers.BertModel,
    tasks_encoded,
    heads: Mapping[str, Head],
    task: str,
    seed: int,
    hyper: Mapping,
) -> dict:
    if (folder / "scores.json").is_file():
        return {**read_json(folder / "scores.json"), "cached": True}
    start = time.perf_counter()
    trained = track.train(base, tasks_encoded[task]["train"], heads[task], seed, **hyper)
    seconds = time.perf_counter() - start
    staging = staging_folder(folder)
    state = track.save(base, trained, staging)
    start = time.perf_counter()
    own = {task: tasks_encoded[task]}  # scored on its own task (the other tasks are the merges' business)
    scores = {split: evaluate(state, own, heads, split, scratch=scratch) for split in EVAL_SPLITS}
    record = {"seconds": {"train": seconds, "eval": time.perf_counter() - start}, **scores}
    write_json(staging / "scores.json", record)
    publish(staging, folder)
    return {**record, "cached": False}


def build_experts(
    cache_dir: str | Path,
    seeds: Sequence[int] = (0,),
    steps: int = 800,
    lr: float | None = None,
    batch_size: int = 32,
    warmup: float = 0.1,
    weight_decay: float = 0.0,
    *,
    track: str = "full",
    rank: int | None = None,
    model_dir: str | Path | None = None,
    manifest: Mapping | None = None,
    log: Callable[[str], None] | None = None,
    train_missing: bool = True,
) -> dict:
    """Build (or read from the cache) tokens, probe heads and one expert per (seed, task); return a summary.

    ``track`` ``full`` fine-tunes the encoder's linear layers (``training.train_expert``, ``lr`` default 1e-4,
    experts saved as model folders under ``experts/``); ``lora`` trains a rank-16 PEFT LoRA adapter per task on
    the same layers (``training.train_lora_expert``, ``lr`` default 5e-4, adapters saved in PEFT's format under
    ``lora-experts/``, each scored as its ``merge_and_unload`` checkpoint); ``rank`` replaces its rank 16 (and
    ``lora_alpha`` becomes 2 x rank).

    ``manifest`` defaults to ``build_tasks(cache_dir)`` (its ``tasks_dir`` is relative to ``cache_dir``);
    ``model_dir`` to the pinned base model. ``train_missing=False`` raises ``AccuracyDataError`` for an expert not
    in the cache instead of training it (for tools that only read experts). ``log`` receives one line per stage. The
    summary (also written to ``experts/<key>/summary-seeds-<seeds>.json``) holds the cache ``paths`` (``tokens``:
    the encoded file, ``heads``, ``experts``: seed -> task -> folder), ``probes`` (per task chosen L2 and base train
    / val / test accuracy), ``experts`` (seed -> task -> val / test accuracy on its own task and seconds),
    ``seconds`` per stage as measured when it was built, ``cached`` flags, and ``eval_sentences_per_second``.
    """
    cache_dir = Path(cache_dir).resolve()
    say = log or (lambda line: None)
    manifest = manifest if manifest is not None else build_tasks(cache_dir)
    base_dir = Path(model_dir) if model_dir is not None else load_base_model_path()
    files = model_files(base_dir)
    base, tokenizer = load_base(base_dir)

    tokenizer_files = {name: sha for name, sha in files.items() if name not in ("config.json", "model.safetensors")}
    tokens_dir, tokens = _tokens_stage(cache_dir, manifest, tokenizer_files, tokenizer)
    say(f"tokens {tokens_dir} ({took(tokens['cached'], tokens['seconds'])})")
    tasks_encoded = load_encoded(tokens_dir / "encoded.safetensors")

    probes_dir, probes = _probes_stage(cache_dir, tokens_dir, files, base, tasks_encoded)
    heads = load_heads(probes_dir / "heads.safetensors")
    say(f"probes {probes_dir} ({took(probes['cached'], sum(probes['seconds'].values()))})")

    if track not in TRACKS:
        raise ValueError(f"unknown expert track {track!r}; choose one of {', '.join(TRACKS)}")
    kind = TRACKS[track]
    hyper = {
        **kind.defaults,
        "steps": steps,
        "batch_size": batch_size,
        "warmup": warmup,
        "weight_decay": weight_decay,
        "autocast": precision.autocast(),
    }
    if lr is not None:
        hyper["lr"] = lr
    if rank is not None:
        if track != "lora":
            raise ValueError("rank is a setting of the LoRA track; pass track='lora'")
        hyper.update(rank=rank, alpha=2 * rank)
    inputs = {
        "probes": probes_dir.name,
        "precision": precision.tag(),
        "hyper": hyper,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "code": code_digest(*kind.code),
        **({"peft": peft.__version__} if track == "lora" else {}),
    }
    experts_dir = cache_dir / kind.folder / digest(inputs)[:16]
    experts_dir.mkdir(parents=True, exist_ok=True)
    write_json(experts_dir / "inputs.json", inputs)
    scratch = copy.deepcopy(base)
    experts, paths = {}, {}
    for seed in seeds:
        experts[seed], paths[seed] = {}, {}
        for task in tasks_encoded:
            folder = experts_dir / f"seed{seed}" / task
            if not train_missing and not (folder / "scores.json").is_file():
                build = f"specmerge-bench accuracy --cache {cache_dir} --track {track}"
                raise AccuracyDataError(f"{folder} is not built (the {track} expert of seed {seed}); build it: {build}")
            record = _expert(folder, kind, base, scratch, tasks_encoded, heads, task, seed, hyper)
            experts[seed][task], paths[seed][task] = record, str(folder)
            gap = record["val"][task] - probes["tasks"][task]["val"]
            timing = took(record["cached"], record["seconds"]["train"])
            say(f"expert seed {seed} {task}: val {record['val'][task]:.3f}, {gap:+.3f} over base ({timing})")

    summary = {
        "track": track,
        "tasks": list(tasks_encoded),
        "hyper": hyper,
        "paths": {
            "tokens": str(tokens_dir / "encoded.safetensors"),
            "heads": str(probes_dir / "heads.safetensors"),
            "experts": paths,
        },
        "probes": probes["tasks"],
        "experts": experts,
        "seconds": {"tokenize": tokens["seconds"], **probes["seconds"]},
        "cached": {"tokens": tokens["cached"], "probes": probes["cached"]},
        "eval_sentences_per_second": probes["eval_sentences_per_second"],
    }
    write_json(experts_dir / f"summary-seeds-{','.join(map(str, seeds))}.json", summary)
    return summary


# ------------------------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specmerge_bench.accuracy.experts --cache DIR [--seeds 0 1 2] [--steps 800] [--lr 1e-4]``:
    build, print."""
    parser = argparse.ArgumentParser(
        prog="python -m specmerge_bench.accuracy.experts", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--cache", required=True, type=Path, help="cache directory (as for specmerge_bench.accuracy.data)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds (default 0)")
    parser.add_argument("--steps", type=int, default=800, help="optimizer steps per expert (default 800)")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate (default 1e-4 for full fine-tuning, 5e-4 for LoRA)")  # fmt: skip
    parser.add_argument("--track", choices=sorted(TRACKS), default="full",
                        help="full: fine-tune the encoder's linear layers; lora: a rank-16 PEFT LoRA adapter "
                             "on them")  # fmt: skip
    parser.add_argument("--precision", choices=precision.PRECISIONS, default="auto",
                        help="bfloat16 autocast or float32 (auto: bfloat16 where the CPU has it natively)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        with precision.using(args.precision):
            summary = build_experts(
                args.cache,
                args.seeds,
                steps=args.steps,
                lr=args.lr,
                track=args.track,
                log=lambda line: print(line, file=sys.stderr),
            )
    except (AccuracyDataError, OSError, ValueError) as err:
        print(f"specmerge_bench.accuracy.experts: error: {err}", file=sys.stderr)
        return 2
    seeds = args.seeds
    header = f"{'task':<28} {'base':>6} " + " ".join(f"{f'seed{s}':>6}" for s in seeds) + f" {'expert':>6} {'gap':>6}"
    print("test accuracy (expert: mean over seeds, on its own task)")
    print(header)
    rows = []
    for task in summary["tasks"]:
        base = summary["probes"][task]["test"]
        per_seed = [summary["experts"][seed][task]["test"][task] for seed in seeds]
        rows.append((base, *per_seed))
        expert = sum(per_seed) / len(per_seed)
        cells = " ".join(f"{value:>6.3f}" for value in per_seed)
        print(f"{task:<28} {base:>6.3f} {cells} {expert:>6.3f} {expert - base:>+6.3f}")
    columns = [sum(column) / len(column) for column in zip(*rows, strict=True)]
    expert = sum(columns[1:]) / len(seeds)
    cells = " ".join(f"{value:>6.3f}" for value in columns[1:])
    print(f"{'average':<28} {columns[0]:>6.3f} {cells} {expert:>6.3f} {expert - columns[0]:>+6.3f}")
    seconds = summary["seconds"]
    train = [summary["experts"][seed][task]["seconds"]["train"] for seed in seeds for task in summary["tasks"]]
    print(
        f"tokenize {seconds['tokenize']:.1f} s, probe features {seconds['features']:.1f} s, probe fit "
        f"{seconds['fit']:.1f} s, base scoring {seconds['base_eval']:.1f} s "
        f"({summary['eval_sentences_per_second']:.0f} sentences/s), experts {sum(train):.0f} s "
        f"({min(train):.0f}-{max(train):.0f} s each); times as measured when each stage was built"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
